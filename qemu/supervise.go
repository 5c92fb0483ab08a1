package qemu

import (
	"context"
	"fmt"
	"syscall"
	"time"
)

// exitUnreportedGrace is how long supervise waits, once QEMU (its child)
// was reaped, for QMP to report the disconnect before it records the exit
// from the process alone.
var exitUnreportedGrace = 3 * time.Second

// supervise drains QMP events (go-qemu's channel is unbuffered: an undrained
// channel blocks command replies), keeps the state, turns guest shutdown and
// panic into an exit, and records the exit when QEMU goes away: when the QMP
// connection closes, or, for a QEMU this process started, when the reaped
// child's QMP stream has not closed within exitUnreportedGrace (go-qemu's
// reader can block on a reply nobody waits for and then never reports the
// end of the connection: the exit must not depend on it alone).
func (vm *VM) supervise() {
	events, _ := vm.mon.Events(context.Background())
	capTicker := time.NewTicker(consoleCapCheckInterval)
	defer capTicker.Stop()
	reaped := vm.childDone // nil for an adopted QEMU: QMP alone tells
	var unreported <-chan time.Time
	for {
		select {
		case e, ok := <-events:
			if !ok {
				vm.onDisconnect()
				return
			}
			ev, typed := fromQMP(e)
			if !typed {
				continue
			}
			vm.handle(ev)
		case <-capTicker.C:
			if err := capConsoleLog(vm.stateDir, vm.consoleCap()); err != nil {
				vm.log.Error(err, "cap console log")
			}
		case <-reaped:
			reaped = nil
			unreported = time.After(exitUnreportedGrace)
		case <-unreported:
			vm.log.Info("QEMU exited but its QMP connection did not report it; recording the exit from the process", "grace", exitUnreportedGrace)
			go func() { // go-qemu's reader may be blocked sending an event
				for range events {
				}
			}()
			vm.onDisconnect()
			return
		}
	}
}

func (vm *VM) consoleCap() int64 {
	if vm.spec.ConsoleCapBytes > 0 {
		return vm.spec.ConsoleCapBytes
	}
	return DefaultConsoleCap
}

func (vm *VM) handle(ev Event) {
	vm.mu.Lock()
	quit := false
	switch e := ev.(type) {
	case Shutdown:
		switch {
		case e.Reason == "guest-panic":
			vm.cause.Panicked = true
			quit = true
		case e.Guest:
			vm.cause.GuestShutdown = true
			quit = true
		case e.Reason == "host-signal":
			vm.cause.HostSignal = true
		}
	case GuestPanicked:
		vm.cause.Panicked = true
		quit = true
	case Stop:
		vm.state = StatePaused
	case Resume:
		vm.state = StateRunning
	}
	vm.broadcastLocked(ev)
	vm.mu.Unlock()
	if kv, notable := notableEvent(ev); notable {
		vm.log.Info("VM event", kv...)
	} else {
		vm.log.V(2).Info("VM event", "event", fmt.Sprintf("%T", ev))
	}
	if quit {
		// With -action shutdown=pause,panic=pause QEMU waits for us: quit it
		// now that the cause is known. Asynchronously: Run needs this
		// goroutine to keep draining events.
		go vm.quit()
	}
}

// notableEvent says whether ev is logged at Info, with its fields: what
// the guest did to itself (panic, shutdown, reset), rare in a VM's life
// and what tells, in a node's log, a guest that panicked but stayed from
// one that reboots into the same panic. Stop, Resume and the power button
// (snapshots, stops) stay at V(2). Pure.
func notableEvent(ev Event) (kv []any, notable bool) {
	switch e := ev.(type) {
	case GuestPanicked:
		return []any{"event", "GuestPanicked", "action", e.Action}, true
	case Shutdown:
		return []any{"event", "Shutdown", "guest", e.Guest, "reason", e.Reason}, true
	case Reset:
		return []any{"event", "Reset", "guest", e.Guest, "reason", e.Reason}, true
	}
	return nil, false
}

func (vm *VM) applyRunState(st string) {
	vm.mu.Lock()
	quit := false
	switch st {
	case "shutdown":
		vm.cause.GuestShutdown = true
		quit = true
	case "guest-panicked":
		vm.cause.Panicked = true
		quit = true
	case "internal-error":
		vm.cause.InternalError = true
		quit = true
	case "running":
		vm.state = StateRunning
	default:
		vm.state = StatePaused
	}
	vm.mu.Unlock()
	if quit {
		go vm.quit()
	}
}

// onDisconnect: the QMP connection closed, so QEMU is exiting. Wait for the
// process to be gone, classify and persist.
func (vm *VM) onDisconnect() {
	vm.mu.Lock()
	detached := vm.closed
	vm.mu.Unlock()
	if detached {
		// Detach closed the connection; QEMU keeps running unsupervised.
		return
	}
	vm.waitGone(10 * time.Second)
	vm.mu.Lock()
	c := vm.cause
	c.ForcedBy = vm.forcing
	c.ProcessStatus = vm.childStatus
	vm.mu.Unlock()
	if vm.childDone != nil {
		<-vm.childDone
		vm.mu.Lock()
		c.ProcessStatus = vm.childStatus
		vm.mu.Unlock()
	}
	ex := classify(c, time.Now())
	if err := writeFileAtomic(vm.spec.Path(ExitFileName), ex.marshal(), 0o600); err != nil {
		vm.log.Error(err, "persist exit record")
	}
	vm.mon.Disconnect()
	vm.removeCgroup()
	vm.finish(ex)
}

// removeCgroup removes the VM's own cgroup (Spec.Cgroup) once QEMU is gone.
func (vm *VM) removeCgroup() {
	if err := removeCgroup(vm.spec); err != nil {
		vm.log.Error(err, "remove the VM's cgroup")
	}
}

// waitGone waits until QEMU's pid is gone (or a zombie), SIGKILLing it after
// d (QEMU closed QMP but hangs).
func (vm *VM) waitGone(d time.Duration) {
	deadline := time.Now().Add(d)
	for qemuAlive(vm.pid, vm.stateDir) {
		if vm.childDone != nil {
			select {
			case <-vm.childDone:
				return
			case <-time.After(20 * time.Millisecond):
			}
		} else {
			time.Sleep(20 * time.Millisecond)
		}
		if time.Now().After(deadline) {
			_ = signalPid(vm.pid, syscall.SIGKILL)
			deadline = time.Now().Add(d)
		}
	}
}

func (vm *VM) finish(ex Exit) {
	vm.mu.Lock()
	defer vm.mu.Unlock()
	if vm.exit != nil {
		return
	}
	vm.exit = &ex
	vm.state = StateExited
	vm.broadcastLocked(Exited{Stamp: Stamp{At: ex.At}, Exit: ex})
	for ch := range vm.subs {
		close(ch)
		delete(vm.subs, ch)
	}
	close(vm.done)
	vm.log.V(1).Info("VM exited", "class", ex.Class, "exitCode", ex.ExitCode, "reason", ex.Reason)
}

// broadcastLocked never blocks: a subscriber that does not keep up loses
// events (its buffer is large; the final Exit is also in Exit()).
func (vm *VM) broadcastLocked(ev Event) {
	for ch := range vm.subs {
		select {
		case ch <- ev:
		default:
			vm.log.Info("event subscriber too slow; dropping event", "event", fmt.Sprintf("%T", ev))
		}
	}
}

// Events returns a new subscription to the VM's typed events. The channel
// is closed after the Exited event, when ctx ends, or when the VM is
// detached (no more events come). Subscribing to an exited VM yields its
// Exited event only; to a detached one, a closed channel.
func (vm *VM) Events(ctx context.Context) <-chan Event {
	ch := make(chan Event, 64)
	vm.mu.Lock()
	if vm.exit != nil {
		ch <- Exited{Stamp: Stamp{At: vm.exit.At}, Exit: *vm.exit}
		close(ch)
		vm.mu.Unlock()
		return ch
	}
	if vm.closed {
		close(ch)
		vm.mu.Unlock()
		return ch
	}
	vm.subs[ch] = struct{}{}
	vm.mu.Unlock()
	go func() {
		select {
		case <-ctx.Done():
			vm.mu.Lock()
			if _, ok := vm.subs[ch]; ok {
				delete(vm.subs, ch)
				close(ch)
			}
			vm.mu.Unlock()
		case <-vm.done:
		case <-vm.detached: // Detach closed ch
		}
	}()
	return ch
}
