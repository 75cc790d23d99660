# corral-worker:latest, built by deploy/images/runtime.sh from a context holding
# rootfs/: usr/local/bin/{corral-worker,corral-init} (static) and tmp/ (1777).
# The worker finds corral-init next to its own executable.
FROM scratch
COPY rootfs/ /
ENTRYPOINT ["/usr/local/bin/corral-worker"]
