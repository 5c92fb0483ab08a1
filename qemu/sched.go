package qemu

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// release starts the guest of a VM launched paused (-S) with a nice
// value: it lowers the vCPU threads to spec.Nice, starts them (cont), then
// lowers QEMU's other threads and QEMU's session if it has one of its own
// (lowerAutogroup). So no guest code runs above spec.Nice, and QEMU's
// start-up (its init, the QMP handshake, the cont) is control path at the
// agent's priority, not slowed by busy guests: in a burst, the main loop
// answering cont at nice 10 waited behind every other QEMU starting up.
func (vm *VM) release(ctx context.Context) error {
	if err := lowerVCPUs(vm.pid, vm.spec.Nice); err != nil {
		return err
	}
	if err := vm.QMP(ctx, "cont", nil, nil); err != nil {
		return fmt.Errorf("start the vCPUs (QMP cont): %w", err)
	}
	if err := reniceProcess(vm.pid, vm.spec.Nice); err != nil {
		return err
	}
	vm.lowerAutogroup()
	return nil
}

// lowerVCPUs sets QEMU's vCPU threads (named "CPU <n>/<accelerator>": Args
// passes debug-threads=on) to nice n; a QEMU whose threads carry no such
// name gets every thread lowered instead.
func lowerVCPUs(pid, n int) error {
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		return fmt.Errorf("threads of QEMU %d: %w", pid, err)
	}
	found := 0
	for _, e := range tasks {
		comm, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/comm", pid, e.Name()))
		if err != nil || !strings.HasPrefix(string(comm), "CPU ") {
			continue
		}
		tid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if err := unix.Setpriority(unix.PRIO_PROCESS, tid, n); err != nil {
			return fmt.Errorf("set nice %d on QEMU %d vCPU thread %d: %w", n, pid, tid, err)
		}
		found++
	}
	if found == 0 {
		return reniceProcess(pid, n)
	}
	return nil
}

// lowerAutogroup gives QEMU's session the VM's nice value as well, when
// QEMU runs in a session other than ours (see setAutogroupNice); where the
// kernel does not let it, the VM runs with its threads lowered only, which
// is logged.
//
// With scheduler autogroups (kernel.sched_autogroup_enabled=1, the default
// of most distributions, for processes in the root CPU cgroup) the kernel
// shares the CPU between sessions first and between the threads of a
// session only then. Start runs QEMU in our session (its own process
// group), so its threads compete with ours thread by thread: a lowered
// guest yields to the agent, and a QEMU starting up weighs what one agent
// thread does. In a session of its own, every QEMU weighed as much as our
// whole session: 30 QEMUs starting at once left the agent (and, on a test
// host, the API server and etcd in its session) 1/31 of the CPU while they
// initialized, and lowering the session afterwards could not help there
// (docs/performance.md). A VM started by an agent before this (Setsid) or
// by anything else still has a session of its own: that session is
// lowered, never ours.
func (vm *VM) lowerAutogroup() {
	own, err := ownSession(vm.pid)
	if err == nil && !own {
		return // our session: its threads' nice values do it
	}
	if err == nil {
		err = setAutogroupNice(vm.pid, vm.spec.Nice)
	}
	if err != nil {
		vm.log.Error(err, "VM not lowered against other sessions: its threads are, which on a host with scheduler autogroups does not lower it against the agent")
	}
}

// ownSession reports whether pid runs in a session other than the
// caller's.
func ownSession(pid int) (bool, error) {
	sid, err := unix.Getsid(pid)
	if err != nil {
		return false, fmt.Errorf("session of QEMU %d: %w", pid, err)
	}
	mine, err := unix.Getsid(0)
	if err != nil {
		return false, fmt.Errorf("own session: %w", err)
	}
	return sid != mine, nil
}

// setAutogroupNice sets the nice value of the scheduler autogroup of pid's
// session (/proc/<pid>/autogroup, Linux's CONFIG_SCHED_AUTOGROUP): the
// session as a whole weighs that nice value against other sessions. Only
// for a process whose session is not the caller's (lowerAutogroup). A
// kernel without autogroups has no such file: nothing to do.
func setAutogroupNice(pid, n int) error {
	f, err := os.OpenFile(fmt.Sprintf("/proc/%d/autogroup", pid), os.O_WRONLY, 0)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err == nil {
		_, err = f.WriteString(strconv.Itoa(n))
		if cerr := f.Close(); err == nil {
			err = cerr
		}
	}
	if err != nil {
		return fmt.Errorf("set the autogroup nice value of QEMU %d to %d: %w", pid, n, err)
	}
	return nil
}

// reniceProcess sets every thread of pid to nice n. Linux nice values are
// per thread and a new thread inherits its creator's, so it goes over the
// threads again until a pass finds none it has not set.
func reniceProcess(pid, n int) error {
	set := map[int]bool{}
	for range 10 {
		tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
		if err != nil {
			return fmt.Errorf("threads of QEMU %d: %w", pid, err)
		}
		fresh := false
		for _, e := range tasks {
			tid, err := strconv.Atoi(e.Name())
			if err != nil || set[tid] {
				continue
			}
			fresh = true
			if err := unix.Setpriority(unix.PRIO_PROCESS, tid, n); err != nil && !errors.Is(err, unix.ESRCH) {
				return fmt.Errorf("set nice %d on QEMU %d thread %d: %w", n, pid, tid, err)
			}
			set[tid] = true
		}
		if !fresh {
			return nil
		}
	}
	return fmt.Errorf("QEMU %d kept creating threads while its nice value was set", pid)
}
