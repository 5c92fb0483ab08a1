package qemu

import (
	"context"
	"fmt"
	"strings"
	"syscall"
	"time"
)

// StopOptions control Stop.
type StopOptions struct {
	// Grace is how long the guest gets to power off after the ACPI power
	// button before QEMU is told to quit (default 30s).
	Grace time.Duration
	// QuitGrace is how long `quit` gets before SIGKILL (default 5s).
	QuitGrace time.Duration
	// NoACPI skips the ACPI power button (and Grace): QEMU is told to quit
	// at once, then killed after QuitGrace, as upstream Jumpstarter's QEMU
	// driver powers off. The guest gets no chance to shut down.
	NoACPI bool
	// Keep lists state-dir file names (globs) to keep; everything else in
	// the state dir is removed after QEMU is gone. Nil keeps nothing, and
	// the state dir itself is removed.
	Keep []string
}

// Stop ends the VM gracefully: ACPI power button (system_powerdown), wait up
// to Grace for the guest to power off, then QMP quit, then SIGKILL (with
// NoACPI: quit at once, then SIGKILL). It then cleans the state dir down to
// opts.Keep. Safe to call on an exited VM (it only cleans) and repeatedly.
// If ctx ends early the remaining steps are skipped straight to SIGKILL.
func (vm *VM) Stop(ctx context.Context, opts StopOptions) (Exit, error) {
	if opts.Grace <= 0 {
		opts.Grace = 30 * time.Second
	}
	if opts.QuitGrace <= 0 {
		opts.QuitGrace = 5 * time.Second
	}
	if _, exited := vm.Exit(); !exited {
		if opts.NoACPI {
			vm.setForcing("stopped at once: QEMU told to quit")
			if err := vm.quitThenKill(ctx, opts.QuitGrace); err != nil {
				return Exit{}, err
			}
		} else {
			graceEnd := time.Now().Add(opts.Grace)
			pctx, cancel := context.WithDeadline(ctx, graceEnd) // a hung QMP must not hold the stop
			if err := vm.QMP(pctx, "system_powerdown", nil, nil); err != nil {
				vm.log.V(1).Info("system_powerdown failed", "err", err)
			}
			cancel()
			if !vm.waitDone(ctx, time.Until(graceEnd)) {
				vm.setForcing(fmt.Sprintf("guest did not power off within %s of the ACPI power button; quit", opts.Grace))
				if err := vm.quitThenKill(ctx, opts.QuitGrace); err != nil {
					return Exit{}, err
				}
			}
		}
	}
	ex, _ := vm.Exit()
	if err := CleanStateDir(vm.stateDir, opts.Keep); err != nil {
		return ex, fmt.Errorf("stop VM %s: %w", vm.spec.Name, err)
	}
	return ex, nil
}

// quitThenKill tells QEMU to quit (QMP quit), waits up to grace for it to
// exit, then SIGKILLs it and waits for the exit record.
func (vm *VM) quitThenKill(ctx context.Context, grace time.Duration) error {
	qctx, cancel := context.WithTimeout(ctx, grace)
	_ = vm.QMP(qctx, "quit", nil, nil)
	cancel()
	if vm.waitDone(ctx, grace) {
		return nil
	}
	vm.Kill()
	// Not bounded by ctx: once we kill, we wait for the exit record so
	// nothing is left half-stopped.
	if !vm.waitDone(context.Background(), 30*time.Second) {
		return fmt.Errorf("stop VM %s: QEMU pid %d still alive after SIGKILL", vm.spec.Name, vm.pid)
	}
	return nil
}

func (vm *VM) setForcing(why string) {
	vm.mu.Lock()
	vm.forcing = why
	vm.mu.Unlock()
}

func (vm *VM) waitDone(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-vm.done:
		return true
	case <-t.C:
		return false
	case <-ctx.Done():
		return false
	}
}

// Kill SIGKILLs QEMU; the exit is classified killed.
func (vm *VM) Kill() {
	vm.mu.Lock()
	if vm.forcing == "" {
		vm.forcing = "QEMU killed (SIGKILL) by the supervisor"
	} else if !strings.Contains(vm.forcing, "SIGKILL") {
		vm.forcing += ", then SIGKILL"
	}
	vm.mu.Unlock()
	if qemuAlive(vm.pid, vm.stateDir) {
		_ = signalPid(vm.pid, syscall.SIGKILL)
	}
}
