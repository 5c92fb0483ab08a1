// Package pinned starts child processes that are to die with this process.
//
// Linux sends a child its parent-death signal (SysProcAttr.Pdeathsig) when
// the thread that forked it ends, not when the process does, and the Go
// runtime does end threads: a goroutine that exits while locked to its
// thread takes the thread with it (qemu's confined start retires the thread
// it dropped capabilities on). A child forked by a goroutine that then
// moved on can be killed at any time by an unrelated exit of that thread.
// Start forks from a thread held for the child's whole life.
package pinned

import (
	"errors"
	"os/exec"
	"runtime"

	"golang.org/x/sys/unix"
)

// Start is cmd.Start run on a goroutine locked to its thread until
// the child has exited, so that cmd.SysProcAttr.Pdeathsig fires only when
// this process ends. The child is reaped by cmd.Wait as usual (the holding
// goroutine waits with WNOWAIT), which the caller still calls.
func Start(cmd *exec.Cmd) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		if err := cmd.Start(); err != nil {
			errc <- err
			return
		}
		errc <- nil
		var info unix.Siginfo
		for {
			err := unix.Waitid(unix.P_PID, cmd.Process.Pid, &info, unix.WEXITED|unix.WNOWAIT, nil)
			if !errors.Is(err, unix.EINTR) {
				return // exited (or already reaped by cmd.Wait: ECHILD)
			}
		}
	}()
	return <-errc
}

// Run is cmd.Run with the child started by Start.
func Run(cmd *exec.Cmd) error {
	if err := Start(cmd); err != nil {
		return err
	}
	return cmd.Wait()
}
