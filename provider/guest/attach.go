package guest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"syscall"

	"github.com/virtual-kubelet/virtual-kubelet/node/api"
	"k8s.io/klog/v2"
)

// ConsoleWriterLockName is the lock file in a pod's state dir held by
// whoever types into the console: the one `kubectl attach -i` allowed at a
// time (exclusive), or the console sessions of the pod's Jumpstarter lease
// (shared: they type together, as on a pty). It is an flock: the kernel
// releases it when the holder closes it or dies.
const ConsoleWriterLockName = "console.writer.lock"

// ErrConsoleBusy: another attachment already writes to the console.
var ErrConsoleBusy = errors.New("another session is attached to the console with stdin (one writer at a time); attach without -i/--stdin to only read")

// ErrConsoleHeldByAttach: a `kubectl attach -i` types into the console, so
// a lease's console session may not.
var ErrConsoleHeldByAttach = errors.New("a kubectl attach -i session on the pod types into the console (the lease's console sessions type together, but not beside it)")

// LockConsoleWriter takes the console writer lock of the state dir dir
// exclusively (kubectl attach -i) without waiting. The returned func
// releases it.
func LockConsoleWriter(dir string) (func(), error) {
	return lockConsoleWriter(dir, syscall.LOCK_EX, ErrConsoleBusy)
}

// ShareConsoleWriter takes the console writer lock of the state dir dir
// shared (a Jumpstarter lease's console session) without waiting: any
// number of sessions hold it at once; it fails with ErrConsoleHeldByAttach
// while a kubectl attach -i holds it, and keeps one from taking it. The
// returned func releases it.
func ShareConsoleWriter(dir string) (func(), error) {
	return lockConsoleWriter(dir, syscall.LOCK_SH, ErrConsoleHeldByAttach)
}

func lockConsoleWriter(dir string, how int, busy error) (func(), error) {
	f, err := os.OpenFile(filepath.Join(dir, ConsoleWriterLockName), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, fmt.Errorf("console writer lock: %w", err)
	}
	if err := syscall.Flock(int(f.Fd()), how|syscall.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, busy
		}
		return nil, fmt.Errorf("console writer lock: %w", err)
	}
	return func() { f.Close() }, nil
}

// AttachConsole connects a kubectl attach session to the VM's serial
// console: guest output from now on goes to stdout; with stdin, what the
// user types goes to the guest (one writer at a time: a second one gets
// ErrConsoleBusy). The session ends when the client goes away (ctx) or the
// VM exits; the end of stdin gives up the writer role but keeps the output
// flowing, as a kubelet does for a container without stdinOnce. Terminal
// resizes are accepted and ignored (a serial line has no window size).
func AttachConsole(ctx context.Context, vm VM, dir string, attach api.AttachIO) error {
	log := klog.FromContext(ctx)
	stdin := attach.Stdin()
	release := func() {}
	if stdin != nil {
		var err error
		if release, err = LockConsoleWriter(dir); err != nil {
			return err
		}
	}
	defer func() { release() }()

	console, err := vm.AttachConsole(ctx)
	if err != nil {
		return err
	}
	defer console.Close()

	if rs := attach.Resize(); rs != nil {
		go func() {
			for {
				select {
				case _, ok := <-rs:
					if !ok {
						return
					}
				case <-ctx.Done():
					return
				}
			}
		}()
	}

	outDone := make(chan error, 1)
	go func() {
		out := attach.Stdout()
		if out == nil {
			out = attach.Stderr()
		}
		if out == nil {
			out = nopWriteCloser{io.Discard}
		}
		_, err := io.Copy(out, console)
		outDone <- err
	}()
	inDone := make(chan error, 1)
	if stdin != nil {
		go func() {
			_, err := io.Copy(console, stdin)
			inDone <- err
		}()
	}

	for {
		select {
		case <-ctx.Done():
			return nil
		case <-vm.Done():
			return nil
		case err := <-outDone:
			// EOF: the VM exited. A write error: the client went away.
			if err != nil {
				log.V(2).Info("Console attach output ended", "err", err)
			}
			return nil
		case err := <-inDone:
			if err != nil {
				log.V(2).Info("Console attach input ended", "err", err)
			}
			release()
			release = func() {}
			inDone = nil
		}
	}
}

type nopWriteCloser struct{ io.Writer }

func (nopWriteCloser) Close() error { return nil }
