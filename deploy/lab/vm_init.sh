#!/bin/sh
# /init of the VM node (deploy/lab/vm.py): mounts, modules, the network from the kernel
# command line (knit.addr=CIDR knit.gw=IP knit.src=DIR knit.port=PORT), knit's checkout over
# 9p at the same path as on the host, then the command agent as PID 1 (deploy/lab/vm_agent.py).
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 HOME=/root
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm /run /tmp /sys/fs/cgroup
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /run
mount -t cgroup2 cgroup2 /sys/fs/cgroup
read -r cmdline < /proc/cmdline
for arg in $cmdline; do
    case $arg in
        knit.addr=*) addr=${arg#knit.addr=} ;;
        knit.gw=*) gw=${arg#knit.gw=} ;;
        knit.src=*) src=${arg#knit.src=} ;;
        knit.port=*) port=${arg#knit.port=} ;;
    esac
done
# The datapaths' modules, loaded now so that no test waits for them: IPVS with the
# schedulers knit-proxyd names, SCTP, and br_netfilter (pods on a bridge reach ClusterIPs).
modprobe -a virtio_pci virtio_net 9pnet_virtio 9p \
    ip_vs ip_vs_rr ip_vs_wrr ip_vs_sh ip_vs_lc sctp br_netfilter dummy veth \
    nf_conntrack nf_tables xt_set ip_set_hash_ip ip_set_hash_ipport ip_set_hash_ipportip \
    ip_set_hash_ipportnet ip_set_hash_net ip_set_bitmap_port
ip link set lo up
ip link set eth0 up
ip address add "$addr" dev eth0
ip route add default via "$gw"
mkdir -p "$src"
mount -t 9p -o trans=virtio,version=9p2000.L,ro knit "$src"
read -r uptime _ < /proc/uptime
echo "knit-vm: init done at ${uptime}s of uptime" > /dev/ttyS0
cd /
# Bytecode in the image's prefix (deploy/lab/vm_image.py PYCACHE): the share is read-only.
exec env PYTHONPATH="$src:/opt/knit/site" PYTHONPYCACHEPREFIX=/opt/knit/pycache \
    python3 "$src/deploy/lab/vm_agent.py" "${addr%/*}" "$port"
