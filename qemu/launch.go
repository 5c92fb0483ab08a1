package qemu

import (
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// startConfined runs cmd.Start so that QEMU holds no capabilities, even
// when the caller runs as root with some (a privileged container, a
// container given the capabilities a cgroup of its own needs): on a thread
// of its own, which empties its capability bounding set (needs
// CAP_SETPCAP; without it the thread's capabilities are still dropped, and
// root regains only what the bounding set holds) and its capability sets
// before the fork. With ns set it first joins that cgroup namespace
// (Cgroup.Namespace; needs CAP_SYS_ADMIN) when the cgroup2 hierarchy
// delegates by namespace (nsDelegate) and the caller is not in it
// already. The thread is never handed back to the Go scheduler: it ends
// with its goroutine. Without capabilities and ns, a plain cmd.Start.
//
// keepCaps leaves the thread's effective and permitted capabilities to a
// child that needs them to change its user (Spec.RunAs: CAP_SETUID,
// CAP_SETGID); the bounding, inheritable and ambient sets are emptied all
// the same, and the child's exec as a user other than root ends the rest.
func startConfined(cmd interface{ Start() error }, ns string, keepCaps bool) error {
	if !nsDelegate(mountinfo()) {
		ns = ""
	}
	return startIn(cmd, ns, keepCaps)
}

// startIn is startConfined that joins ns (if set and not the caller's).
func startIn(cmd interface{ Start() error }, ns string, keepCaps bool) error {
	join := false
	if ns != "" {
		self, err1 := os.Readlink("/proc/thread-self/ns/cgroup")
		target, err2 := os.Readlink(ns)
		if err2 != nil {
			return fmt.Errorf("cgroup namespace %s: %w", ns, err2)
		}
		join = err1 != nil || self != target
	}
	drop := threadHasCaps()
	if !join && !drop {
		return cmd.Start()
	}
	errc := make(chan error, 1)
	var confined func()
	confined = func() {
		runtime.LockOSThread() // never unlocked: see above
		if unix.Gettid() == unix.Getpid() {
			// The main thread (Go wedges rather than ends it, and
			// /proc/self shows it): while it stays locked here, hand the
			// work to a goroutine that cannot land on it, then give it
			// back untouched.
			done := make(chan struct{})
			go func() { defer close(done); confined() }()
			<-done
			runtime.UnlockOSThread()
			return
		}
		if join {
			fd, err := unix.Open(ns, unix.O_RDONLY|unix.O_CLOEXEC, 0)
			if err != nil {
				errc <- fmt.Errorf("cgroup namespace %s: %w", ns, err)
				return
			}
			err = unix.Setns(fd, unix.CLONE_NEWCGROUP)
			unix.Close(fd)
			if err != nil {
				errc <- fmt.Errorf("join cgroup namespace %s (needs CAP_SYS_ADMIN): %w", ns, err)
				return
			}
		}
		if drop {
			if err := dropThreadCaps(keepCaps); err != nil {
				errc <- err
				return
			}
		}
		errc <- cmd.Start()
	}
	go confined()
	return <-errc
}

// nsDelegate reports whether the cgroup2 hierarchy is mounted with
// nsdelegate (systemd mounts it so), which makes cgroup namespaces
// delegation boundaries: only then may a process in a cgroup namespace of
// its own not place a process outside it. Without it (cgroup v1, or a
// cgroup2 mount without the option) no namespace needs joining.
func nsDelegate(mountinfo string) bool {
	for _, l := range strings.Split(mountinfo, "\n") {
		_, post, ok := strings.Cut(l, " - ")
		f := strings.Fields(post)
		if !ok || len(f) < 3 || f[0] != "cgroup2" {
			continue
		}
		for _, o := range strings.Split(f[2], ",") {
			if o == "nsdelegate" {
				return true
			}
		}
	}
	return false
}

func mountinfo() string {
	b, _ := os.ReadFile("/proc/self/mountinfo")
	return string(b)
}

// threadHasCaps reports whether the calling thread holds any capability
// (effective, permitted or bounding).
func threadHasCaps() bool {
	b, err := os.ReadFile("/proc/thread-self/status")
	if err != nil {
		return true // cannot tell: drop them
	}
	for _, l := range strings.Split(string(b), "\n") {
		for _, f := range []string{"CapPrm:", "CapEff:", "CapBnd:", "CapAmb:", "CapInh:"} {
			if v, ok := strings.CutPrefix(l, f); ok {
				if n, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64); err != nil || n != 0 {
					return true
				}
			}
		}
	}
	return false
}

// dropThreadCaps empties the calling thread's bounding set (when it may),
// its ambient and inheritable sets and, unless keep, its effective and
// permitted sets, so that a program it executes, root or not, starts with
// none (with keep: once it leaves root, which a Credential does).
func dropThreadCaps(keep bool) error {
	last := 63
	if b, err := os.ReadFile("/proc/sys/kernel/cap_last_cap"); err == nil {
		if n, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil {
			last = n
		}
	}
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	data := [2]unix.CapUserData{}
	if err := unix.Capget(&hdr, &data[0]); err == nil && data[0].Effective&(1<<unix.CAP_SETPCAP) != 0 {
		for c := 0; c <= last; c++ {
			if err := unix.Prctl(unix.PR_CAPBSET_DROP, uintptr(c), 0, 0, 0); err != nil && err != unix.EINVAL {
				return fmt.Errorf("drop capability %d from the bounding set: %w", c, err)
			}
		}
	}
	if err := unix.Prctl(unix.PR_CAP_AMBIENT, unix.PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0); err != nil && err != unix.EINVAL {
		return fmt.Errorf("clear the ambient capabilities: %w", err)
	}
	hdr = unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	cur := [2]unix.CapUserData{}
	if err := unix.Capget(&hdr, &cur[0]); err != nil {
		return fmt.Errorf("read capabilities: %w", err)
	}
	data = [2]unix.CapUserData{}
	if keep {
		for i := range data {
			data[i].Effective, data[i].Permitted = cur[i].Effective, cur[i].Permitted
		}
	}
	hdr = unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	if err := unix.Capset(&hdr, &data[0]); err != nil {
		return fmt.Errorf("drop capabilities before starting QEMU: %w", err)
	}
	return nil
}
