#!/usr/bin/env bash
# Builds the default sandbox image (corral-sandbox:latest) locally, with no
# registry: an empty root filesystem holding Debian's static busybox (with a
# link per applet) and static bash, its user database linked to the one the
# supervisor writes for each sandbox's own uid, imported with
# `docker import`. Needs: docker, and the busybox-static and bash-static
# packages (installed with apt-get when missing and running as root).
set -euo pipefail

tag=${1:-corral-sandbox:latest}

busybox=/bin/busybox
bash_static=/bin/bash-static
if [ ! -x "$busybox" ] || [ ! -x "$bash_static" ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq busybox-static bash-static >/dev/null
    else
        echo "build.sh: needs $busybox and $bash_static (apt-get install busybox-static bash-static)" >&2
        exit 1
    fi
fi
if ! file_out=$(LC_ALL=C "$busybox" true 2>&1); then
    echo "build.sh: $busybox does not run: $file_out" >&2
    exit 1
fi

root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
# mktemp makes it 0700: the image's / must be readable by the sandbox user.
chmod 0755 "$root"
mkdir -p "$root"/{bin,sbin,usr/bin,usr/sbin,etc,tmp,workspace,root}
cp "$busybox" "$root/bin/busybox"
cp "$bash_static" "$root/bin/bash"
for applet in $("$busybox" --list); do
    [ -e "$root/bin/$applet" ] || ln -s busybox "$root/bin/$applet"
done
ln -s /bin/env "$root/usr/bin/env"
# The image's accounts; the sandbox user (a uid of its own in every
# sandbox) is added by the supervisor, which writes the database the links
# below point to.
cat > "$root/etc/passwd.image" <<'PASSWD'
root:x:0:0:root:/root:/bin/sh
nobody:x:65534:65534:nobody:/nonexistent:/bin/false
PASSWD
cat > "$root/etc/group.image" <<'GROUP'
root:x:0:
nogroup:x:65534:
GROUP
ln -s /run/corral/passwd "$root/etc/passwd"
ln -s /run/corral/group "$root/etc/group"
# In a sandbox a tmpfs covers these; in a `docker build` FROM this image
# (no supervisor) they are the image's accounts, so `USER root` works.
mkdir -p "$root/run/corral"
cp "$root/etc/passwd.image" "$root/run/corral/passwd"
cp "$root/etc/group.image" "$root/run/corral/group"
chmod 1777 "$root/tmp"

tar -C "$root" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'WORKDIR /workspace' \
    --change 'LABEL corral.image=sandbox' \
    - "$tag" >/dev/null
echo "built $tag"
