#!/bin/busybox sh
# init for the qemu-kubelet test images (hack/build-test-image.sh).
# VARIANT is substituted at build time: acpi | noacpi | panic; CONSOLE is
# the serial console: ttyS0 (x86) | ttyAMA0 (arm64 virt).
VARIANT=@VARIANT@
CONSOLE=@CONSOLE@
/bin/busybox --install -s /bin
export PATH=/bin
mkdir -p /proc /sys /dev /tmp /run /www
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
# Linux 6.1's virtio_balloon sets the free page reporting order when it
# registers, over the command line's page_reporting.page_reporting_order;
# later kernels keep the command line's. Put it back right after the
# driver loads, before the first report (2 s after registration), so the
# test guest reports as a later kernel does.
PRORDER=
for a in $(cat /proc/cmdline); do
  [ "$a" = -- ] && break
  case "$a" in page_reporting.page_reporting_order=*) PRORDER=${a#*=} ;; esac
done
for m in $(cat /etc/qk-modules); do
  [ -f "/lib/modules/$m.ko" ] && insmod "/lib/modules/$m.ko" 2>/dev/null
  if [ "$m" = virtio_balloon ] && [ -n "$PRORDER" ]; then
    echo "$PRORDER" > /sys/module/page_reporting/parameters/page_reporting_order 2>/dev/null
  fi
done
# A kernel with virtio_balloon built in (QK_TESTIMAGE_KERNEL=minimal)
# registered it before init: put the order back now.
if [ -n "$PRORDER" ] && ! grep -qx virtio_balloon /etc/qk-modules; then
  echo "$PRORDER" > /sys/module/page_reporting/parameters/page_reporting_order 2>/dev/null
fi
# The modules are in the kernel now. The root file system is the
# initramfs (tmpfs: its files are guest RAM) and nothing loads a module
# later, so their files go, as an initramfs is freed once its init has
# done its work.
rm -rf /lib/modules /etc/qk-modules
echo 1 > /proc/sys/kernel/printk 2>/dev/null

ifconfig lo 127.0.0.1 up
# virtio-net appears asynchronously after insmod: when the VM has a
# virtio network device (virtio device id 0x0001), wait up to ~10s for eth0
# (emulated guests on a loaded host are slow).
i=0
grep -qx 0x0001 /sys/bus/virtio/devices/*/device 2>/dev/null || i=100
while [ ! -e /sys/class/net/eth0 ] && [ $i -lt 100 ]; do usleep 100000; i=$((i+1)); done
if ifconfig eth0 10.0.2.15 netmask 255.255.255.0 up 2>/dev/null; then
  route add default gw 10.0.2.2 2>/dev/null
fi
# Guest disks with a serial (qemu-kubelet's config and scratch disks):
# print each file of a FAT one with its md5, so tests see what the guest sees.
for b in /sys/block/vd*; do
  [ -e "$b/serial" ] || continue
  s=$(cat "$b/serial")
  [ -n "$s" ] || continue
  mkdir -p "/mnt/$s"
  if mount -t vfat -o ro "/dev/${b##*/}" "/mnt/$s" 2>/dev/null; then
    (cd "/mnt/$s" && find . -type f | sort | while read -r f; do
      echo "QK-CONFIG $s ${f#./} $(md5sum < "$f" | cut -d' ' -f1)"
    done)
  else
    echo "QK-DISK $s $(cat "$b/size") sectors"
  fi
done
# The NoCloud seed (the FAT disk labelled CIDATA the node attaches): this
# image is no cloud-init; it applies one subset of a #cloud-config
# vendor-data, the guest login qemu-kubelet seeds for a Jumpstarter
# exporter pod: each chpasswd.users entry (name, password; plain or
# single-quoted YAML scalars) becomes a user with that password, uid 1000
# on, shell /bin/sh (the image has no bash), home /home/<name>. The
# password is hashed (sha512) into /etc/shadow and never printed.
# Anything else in the seed is ignored.
printf 'root:x:0:0:root:/root:/bin/sh\n' > /etc/passwd
printf 'root:x:0:\n' > /etc/group
printf 'root:*:0:0:99999:7:::\n' > /etc/shadow
chmod 0600 /etc/shadow
printf '/bin/sh\n' > /etc/shells
seed=$(findfs LABEL=CIDATA 2>/dev/null)
if [ -n "$seed" ] && mkdir -p /run/nocloud && mount -t vfat -o ro "$seed" /run/nocloud 2>/dev/null; then
  uid=1000
  if [ -f /run/nocloud/vendor-data ]; then
    awk '
      function scalar(v) {
        sub(/^[ \t]+/, "", v); sub(/[ \t]+$/, "", v)
        if (v ~ /^\x27.*\x27$/) { v = substr(v, 2, length(v) - 2); gsub(/\x27\x27/, "\x27", v) }
        else if (v ~ /^"/) v = ""   # double-quoted: not in this subset
        return v
      }
      function flush() { if (name != "" && pass != "") printf "%s\t%s\n", name, pass; name = ""; pass = "" }
      /^[^ #-]/ { flush(); top = $0; sub(/:.*/, "", top); sub_ = ""; next }
      top != "chpasswd" { next }
      /^  [a-z_]+:/ { flush(); sub_ = $0; sub(/^  /, "", sub_); sub(/:.*/, "", sub_); next }
      sub_ != "users" { next }
      /^  *- / { flush(); sub(/^  *- /, "    ") }
      /^    name:/ { v = $0; sub(/^    name:/, "", v); name = scalar(v) }
      /^    password:/ { v = $0; sub(/^    password:/, "", v); pass = scalar(v) }
      END { flush() }
    ' /run/nocloud/vendor-data > /run/nocloud-users
  fi
  while IFS=$(printf '\t') read -r user pass; do
    case "$user" in ''|root|*[!a-z0-9_-]*) continue ;; esac
    hash=$(printf '%s\n' "$pass" | mkpasswd -m sha512)
    echo "$user:x:$uid:$uid::/home/$user:/bin/sh" >> /etc/passwd
    echo "$user:x:$uid:" >> /etc/group
    echo "$user:$hash:0:0:99999:7:::" >> /etc/shadow
    mkdir -p "/home/$user" && chown "$uid:$uid" "/home/$user"
    echo "QK-LOGIN-USER $user uid=$uid"
    uid=$((uid+1))
  done < /run/nocloud-users 2>/dev/null
  rm -f /run/nocloud-users
  umount /run/nocloud
fi
# acpid before httpd: the HTTP server is what readiness probes see, and a
# pod deleted as soon as it is Ready must find the power button handled.
if [ "$VARIANT" = acpi ]; then
  # busybox acpid's built-in tables map KEY_POWER to the event PWRF/00000080
  # and run ./PWRF/00000080 under the -c directory.
  mkdir -p /etc/acpi/PWRF
  printf '#!/bin/sh\necho QK-ACPI-POWERDOWN > /dev/%s\nexec poweroff -f\n' "$CONSOLE" > /etc/acpi/PWRF/00000080
  chmod 0755 /etc/acpi/PWRF/00000080
  # acpid daemonizes before it opens /dev/input/event*: a button pressed
  # between its return and that open is lost (seen under load: a pod
  # deleted as soon as it was Ready waited its whole grace period out).
  # So it runs in the foreground, backgrounded here, and init waits up to
  # ~10s until it holds an event device open.
  acpid -f -c /etc/acpi -l /tmp/acpid.log &
  apid=$!
  i=0
  while [ $i -lt 100 ] && ! ls -l "/proc/$apid/fd" 2>/dev/null | grep -q /dev/input/event; do
    usleep 100000; i=$((i+1))
  done
  [ $i -lt 100 ] || echo "QK-ACPI-NOTREADY (acpid holds no /dev/input/event* after 10s)"
fi
echo "QK-HTTP-OK" > /www/index.html
# GET /cgi-bin/burn?SECS keeps one vCPU busy for SECS seconds (default 60,
# at most 3600) in the background, for CPU autoscaling tests; GET
# /cgi-bin/idle stops every burn.
mkdir -p /www/cgi-bin
cat > /www/cgi-bin/burn <<'BURN'
#!/bin/sh
secs=${QUERY_STRING:-60}
case "$secs" in ''|*[!0-9]*) secs=60 ;; esac
[ "$secs" -gt 3600 ] && secs=3600
timeout "$secs" sh -c 'while :; do :; done' </dev/null >/dev/null 2>&1 &
echo $! >> /tmp/qk-burn.pids
printf 'Content-Type: text/plain\r\n\r\nQK-BURN %s\n' "$secs"
BURN
cat > /www/cgi-bin/idle <<'IDLE'
#!/bin/sh
# busybox timeout execs the loop in the process the shell forked: $! above.
for p in $(cat /tmp/qk-burn.pids 2>/dev/null); do kill "$p" 2>/dev/null; done
rm -f /tmp/qk-burn.pids
printf 'Content-Type: text/plain\r\n\r\nQK-IDLE\n'
IDLE
chmod 0755 /www/cgi-bin/burn /www/cgi-bin/idle
httpd -p 8080 -h /www

# qemu-guest-agent (when the image has it and qk.noagent is not on the
# kernel command line) on the virtio-serial port org.qemu.guest_agent.0:
# without udev there is no /dev/virtio-ports link, so the port's vportNpM
# device is found by name in sysfs (virtio_console, loaded above, makes it
# appear asynchronously: wait up to ~10s when the VM has a virtio-serial
# device, virtio device id 0x0003).
case " $(cat /proc/cmdline) " in
  *" qk.noagent "*) echo "QK-AGENT-OFF" ;;
  *)
    if [ -x /bin/qemu-ga ]; then
      port=""
      i=0
      grep -qx 0x0003 /sys/bus/virtio/devices/*/device 2>/dev/null || i=100
      while [ -z "$port" ] && [ $i -lt 100 ]; do
        for n in /sys/class/virtio-ports/*/name; do
          [ "$(cat "$n" 2>/dev/null)" = org.qemu.guest_agent.0 ] && port=$(basename "$(dirname "$n")")
        done
        [ -n "$port" ] || { usleep 100000; i=$((i+1)); }
      done
      if [ -n "$port" ] && [ -e "/dev/$port" ]; then
        mkdir -p /run /var/run
        qemu-ga -m virtio-serial -p "/dev/$port" -t /run -f /run/qemu-ga.pid -l /tmp/qemu-ga.log &
        echo "QK-AGENT-OK port=$port"
      else
        echo "QK-AGENT-NOPORT (no org.qemu.guest_agent.0 virtio-serial port; virtio_console loaded: $(grep -c '^virtio_console ' /proc/modules))"
      fi
    fi
    ;;
esac

# sshd: dropbear on port 22 (when the image has it), password login
# allowed, host keys generated at the first connection that needs one (-R).
if [ -x /bin/dropbear ]; then
  mkdir -p /etc/dropbear /dev/pts /var/log
  mount -t devpts devpts /dev/pts 2>/dev/null
  : > /var/log/lastlog
  dropbear -R -p 22 && echo "QK-SSHD-OK port=22"
fi

echo "QK-BOOT-OK variant=$VARIANT kernel=$(uname -r) arch=$(uname -m)"

# qk.state on the kernel command line (state preservation tests): the
# image's disk (the first virtio disk without a serial: the pod's overlay)
# holds a record at 1 MiB, "QKSTATE <token> <boots>", written by the guest
# with a fresh random token when the disk has none. Each boot counts itself
# in it and prints "QK-STATE <token> <boots>"; boot 1 then reboots the
# guest (QEMU resets, same process), boot 2 powers it off (a new VM start
# under restartPolicy Always), later boots stay up.
case " $(cat /proc/cmdline) " in
  *" qk.state "*)
    sdev=
    for b in /sys/block/vd*; do
      [ -e "$b" ] || continue
      [ -n "$(cat "$b/serial" 2>/dev/null)" ] && continue
      sdev=${b##*/}; break
    done
    if [ -z "$sdev" ]; then
      echo "QK-STATE-NODISK"
    else
      set -- $(dd if="/dev/$sdev" bs=512 skip=2048 count=1 2>/dev/null | tr -d '\000' | head -n1)
      case "$3" in ''|*[!0-9]*) set -- "$1" "$2" 0 ;; esac
      if [ "$1" = QKSTATE ] && [ -n "$2" ]; then tok=$2; n=$(( $3 + 1 )); else
        tok=$(head -c 16 /dev/urandom | md5sum | cut -c1-12); n=1; fi
      printf 'QKSTATE %s %s\n' "$tok" "$n" | dd of="/dev/$sdev" bs=512 seek=2048 count=1 conv=notrunc,sync,fsync 2>/dev/null
      sync
      echo "QK-STATE $tok $n"
      case "$n" in
        1) echo "QK-STATE-REBOOT"; sleep 1; reboot -f ;;
        2) echo "QK-STATE-POWEROFF"; sleep 1; poweroff -f ;;
      esac
    fi ;;
esac

# qk.poweroff on the kernel command line: power off once booted (exit 0),
# as a guest whose work is done.
case " $(cat /proc/cmdline) " in
  *" qk.poweroff "*) echo "QK-POWEROFF"; poweroff -f ;;
esac

if [ "$VARIANT" = panic ]; then
  # The node learns of the panic from pvpanic (pvpanic-mmio on x86's ACPI
  # QEMU0001, pvpanic-pci on arm64 virt), bound when its module was
  # insmod'ed above. A panic it cannot report reboots the guest
  # (panic=-1) into the same panic, for ever, while the pod reads Running:
  # say so on the console first.
  pvbound() {
    for d in /sys/bus/platform/drivers/pvpanic-mmio/*:* /sys/bus/pci/drivers/pvpanic-pci/*:*; do
      [ -e "$d" ] && return 0
    done
    return 1
  }
  i=0
  while ! pvbound && [ $i -lt 50 ]; do usleep 100000; i=$((i+1)); done
  pvbound || echo "QK-PANIC-UNREPORTED (no pvpanic device bound after 5s; modules: $(grep -o '^pvpanic[a-z_]*' /proc/modules | tr '\n' ' '))"
  echo "QK-PANIC-NOW"
  echo c > /proc/sysrq-trigger
  exit 1
fi

# Console: echo every line typed on the serial console back, prefixed, forever.
while true; do
  while read -r line; do
    echo "QK-ECHO: $line"
  done < "/dev/$CONSOLE" > "/dev/$CONSOLE" 2>&1
  sleep 1
done
