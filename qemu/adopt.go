package qemu

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/go-logr/logr"
)

// Adopt re-attaches to the VM whose state lives in stateDir, e.g. after the
// caller restarted. A VM still running comes back running; a VM found dead
// comes back exited, with the exit recorded in the state dir when there is
// one (otherwise classified crashed), and a VM that shut down or panicked
// while nobody supervised it is classified from QEMU's run state and then
// quit.
func Adopt(ctx context.Context, stateDir string) (*VM, error) {
	abs, err := filepath.Abs(stateDir)
	if err != nil {
		return nil, fmt.Errorf("state dir %q: %w", stateDir, err)
	}
	b, err := os.ReadFile(filepath.Join(abs, SpecFileName))
	if err != nil {
		return nil, fmt.Errorf("adopt %s: read spec: %w", abs, err)
	}
	var spec Spec
	if err := json.Unmarshal(b, &spec); err != nil {
		return nil, fmt.Errorf("adopt %s: parse spec: %w", abs, err)
	}
	spec.StateDir = abs
	log := logr.FromContextOrDiscard(ctx).WithValues("vm", spec.Name, "stateDir", abs)
	pid, _ := readPidfile(abs)
	vm := newVM(spec, abs, pid, log)

	if !qemuAlive(pid, abs) {
		ex, err := readExit(abs)
		if err != nil {
			ex = classify(cause{Unsupervised: true}, time.Now())
			if werr := writeFileAtomic(spec.Path(ExitFileName), ex.marshal(), 0o600); werr != nil {
				log.Error(werr, "persist exit record")
			}
		}
		vm.removeCgroup()
		vm.finish(ex)
		return vm, nil
	}
	if err := vm.connect(ctx); err != nil {
		return nil, fmt.Errorf("adopt %s: QEMU pid %d is alive but QMP failed: %w", abs, pid, err)
	}
	// What happened while nobody listened? Events are not replayed; the run
	// state tells.
	st, err := vm.queryStatus(ctx)
	if err == nil {
		vm.applyRunState(st)
	}
	go vm.supervise()
	if st == "prelaunch" && spec.Nice > 0 {
		// The agent died between launch and release: finish the start.
		if err := vm.release(ctx); err != nil {
			return nil, fmt.Errorf("adopt %s: %w", abs, err)
		}
	}
	vm.holdGuestAgent()
	return vm, nil
}

func readExit(dir string) (Exit, error) {
	var ex Exit
	b, err := os.ReadFile(filepath.Join(dir, ExitFileName))
	if err != nil {
		return ex, err
	}
	if err := json.Unmarshal(b, &ex); err != nil {
		return ex, fmt.Errorf("parse %s: %w", ExitFileName, err)
	}
	return ex, nil
}
