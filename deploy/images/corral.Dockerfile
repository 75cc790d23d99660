# corral:latest, built by deploy/images/runtime.sh from a context holding
# rootfs/: usr/local/bin/corral (static) and tmp/ (1777).
FROM scratch
COPY rootfs/ /
ENTRYPOINT ["/usr/local/bin/corral"]
