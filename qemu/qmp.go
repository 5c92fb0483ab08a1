package qemu

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"
)

// QMP commands and a hung QEMU. go-qemu's Run has no timeout and runs one
// command at a time (a mutex, then a wait for the reply). A caller that
// gives up on a reply cannot take the command back: the goroutine in Run
// stays until the reply comes or the connection closes. So the VM runs at
// most one command at a time (qmpSlot): a command waits for the slot under
// its own context, and the goroutine in Run frees the slot when Run
// returns. However many callers time out against a hung QEMU (probes,
// stats, stop), at most one goroutine per VM waits on QMP, and it ends when
// the reply comes, QEMU exits, or the VM is detached (the connection is
// closed).

// quitTimeout bounds the QMP quit the supervisor sends after a guest
// shutdown or panic (QEMU waits paused for it): without a reply in time
// QEMU is killed, so the exit is still recorded (classified by its cause).
var quitTimeout = 10 * time.Second

var (
	errVMExited   = errors.New("VM exited")
	errVMDetached = errors.New("VM detached")
)

// run executes a QMP command bounded by ctx (see above).
func (vm *VM) run(ctx context.Context, cmd any) ([]byte, error) {
	if vm.mon == nil {
		return nil, errors.New("VM is not connected")
	}
	raw, err := json.Marshal(cmd)
	if err != nil {
		return nil, err
	}
	select { // detached or exited first: a free slot must not win the race
	case <-vm.detached:
		return nil, errVMDetached
	case <-vm.done:
		return nil, errVMExited
	default:
	}
	select {
	case vm.qmpSlot <- struct{}{}:
	case <-ctx.Done():
		return nil, fmt.Errorf("QMP busy: an earlier command is still waiting for QEMU's reply: %w", ctx.Err())
	case <-vm.done:
		return nil, errVMExited
	case <-vm.detached:
		return nil, errVMDetached
	}
	type res struct {
		b   []byte
		err error
	}
	ch := make(chan res, 1)
	go func() {
		b, err := vm.mon.Run(raw)
		<-vm.qmpSlot
		ch <- res{b, err}
	}()
	select {
	case r := <-ch:
		return r.b, r.err
	case <-ctx.Done():
		return nil, fmt.Errorf("no reply from QEMU: %w", ctx.Err())
	case <-vm.done:
		return nil, errVMExited
	case <-vm.detached:
		return nil, errVMDetached
	}
}

// quit tells QEMU to quit (after a guest shutdown or panic), bounded by
// quitTimeout; a QEMU that does not answer, or is still there quitTimeout
// after the command failed, is killed (unless the VM was detached).
func (vm *VM) quit() {
	ctx, cancel := context.WithTimeout(context.Background(), quitTimeout)
	defer cancel()
	err := vm.QMP(ctx, "quit", nil, nil)
	switch {
	case err == nil, errors.Is(err, errVMExited), errors.Is(err, errVMDetached):
		return
	case ctx.Err() != nil:
		vm.log.Info("QEMU did not answer quit; killing it", "timeout", quitTimeout)
		vm.Kill()
	default:
		// QEMU closes the connection as it quits, so the reply may be lost
		// and the error is then the connection's end. But QEMU may also
		// still be there, paused (guest shutdown or panic), waiting for a
		// quit that never came: whatever the error, it gets quitTimeout to
		// go away and is killed if it does not, so the exit is recorded.
		t := time.NewTimer(quitTimeout)
		defer t.Stop()
		select {
		case <-vm.done:
			vm.log.V(2).Info("quit: QEMU exited; its reply was lost", "err", err)
		case <-vm.detached: // left running on purpose, for the next agent
		case <-t.C:
			vm.log.Info("QEMU did not quit after a failed quit command; killing it", "err", err, "timeout", quitTimeout)
			vm.Kill()
		}
	}
}
