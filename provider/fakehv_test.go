package provider

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/qemu"
)

// fakeHypervisor is a Hypervisor whose VMs are values in memory: no QEMU,
// no guest. A VM runs until the test makes it exit (crash, guest power
// off, panic), Stop or Kill ends it; starts can be made to fail; and a
// VM left behind in a state dir (detached, as at an agent restart, or put
// there by the test) is what Adopt finds, running or ended, unless the dir
// is marked not adoptable. It outlives the providers that use it, as QEMU
// processes outlive the agent.
type fakeHypervisor struct {
	mu sync.Mutex
	// procs is the VM each state dir holds (the last one started there).
	procs   map[string]*fakeVM
	nextPid int
	// failStarts starts fail next, with startErr.
	failStarts int
	startErr   error
	// adoptErr: dirs whose Adopt fails with this error.
	adoptErr map[string]error
	starts   int
	adopts   int
	// started receives every VM started (buffered; never blocks a start).
	started chan *fakeVM
	// guestUp: the guests of the VMs answer exec with exit code 0 (else
	// GuestExec fails, as with no guest agent).
	guestUp atomic.Bool
	// guestUpFrom: the VMs of this start on (1 is the first) have guests
	// that answer from their start, whatever guestUp says (0: guestUp
	// alone decides). Set before the first start.
	guestUpFrom int
}

func newFakeHypervisor() *fakeHypervisor {
	return &fakeHypervisor{procs: map[string]*fakeVM{}, adoptErr: map[string]error{}, nextPid: 100000, started: make(chan *fakeVM, 1000)}
}

var _ Hypervisor = (*fakeHypervisor)(nil)

// Start "launches" a VM: it writes spec.json to dir as package qemu does
// (recovery looks for it) and runs until told otherwise.
func (h *fakeHypervisor) Start(ctx context.Context, spec qemu.Spec, dir string) (VM, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("fake start in %s: %w", dir, err)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.failStarts > 0 {
		h.failStarts--
		return nil, h.startErr
	}
	if old := h.procs[dir]; old != nil {
		if _, ended := old.Exit(); !ended {
			return nil, fmt.Errorf("fake start in %s: VM pid %d still runs there", dir, old.pid)
		}
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	b, _ := json.Marshal(spec)
	if err := os.WriteFile(filepath.Join(dir, qemu.SpecFileName), b, 0o600); err != nil {
		return nil, fmt.Errorf("fake start in %s: %w", dir, err)
	}
	h.nextPid++
	h.starts++
	vm := &fakeVM{dir: dir, pid: h.nextPid, spec: spec, done: make(chan struct{}), stopCalled: make(chan struct{}), guestUp: &h.guestUp,
		guestFromStart: h.guestUpFrom > 0 && h.starts >= h.guestUpFrom,
		startTimes:     qemu.StartTimes{Begin: time.Now(), Exec: time.Now(), QMP: time.Now(), Released: time.Now()}}
	h.procs[dir] = vm
	h.started <- vm
	return vm, nil
}

// Adopt returns the VM left in dir, running or ended, as it is (same pid,
// no start); an error when dir is marked not adoptable or holds none.
func (h *fakeHypervisor) Adopt(_ context.Context, dir string) (VM, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if err := h.adoptErr[dir]; err != nil {
		return nil, err
	}
	vm := h.procs[dir]
	if vm == nil {
		return nil, fmt.Errorf("fake adopt %s: no VM was started there", dir)
	}
	h.adopts++
	vm.mu.Lock()
	vm.detached = false
	vm.mu.Unlock()
	return vm, nil
}

// vmIn is the VM dir holds (nil: none).
func (h *fakeHypervisor) vmIn(dir string) *fakeVM {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.procs[dir]
}

func (h *fakeHypervisor) counts() (starts, adopts int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.starts, h.adopts
}

// runningVMs are the VMs that have not ended (leaks, at a test's end).
func (h *fakeHypervisor) runningVMs() []*fakeVM {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []*fakeVM
	for _, vm := range h.procs {
		if _, ended := vm.Exit(); !ended {
			out = append(out, vm)
		}
	}
	return out
}

// failNextStarts makes the next n starts fail with err.
func (h *fakeHypervisor) failNextStarts(n int, err error) {
	h.mu.Lock()
	h.failStarts, h.startErr = n, err
	h.mu.Unlock()
}

func (h *fakeHypervisor) setAdoptErr(dir string, err error) {
	h.mu.Lock()
	h.adoptErr[dir] = err
	h.mu.Unlock()
}

// fakeVM is one VM of a fakeHypervisor.
type fakeVM struct {
	dir        string
	pid        int
	spec       qemu.Spec
	startTimes qemu.StartTimes
	done       chan struct{}
	// stopCalled is closed by the first Stop.
	stopCalled chan struct{}
	// guestUp is its hypervisor's; guestFromStart: its guest answers
	// from its start (fakeHypervisor.guestUpFrom).
	guestUp        *atomic.Bool
	guestFromStart bool

	mu       sync.Mutex
	exit     *qemu.Exit
	detached bool
	stops    int
	kills    int
	// stopOpts are the options of each Stop, in order.
	stopOpts []qemu.StopOptions
	// holdStop: Stop waits (the guest ignores the power button) until the
	// VM ends some other way (crash, Kill) or the stop's context ends.
	holdStop bool
}

var _ VM = (*fakeVM)(nil)

// crashExit is how package qemu reports a QEMU that died of SIGKILL sent
// by someone else.
func crashExit() qemu.Exit {
	return qemu.Exit{Class: qemu.ExitCrashed, ExitCode: qemu.ExitCodeCrashed, Reason: "QEMU exited unexpectedly (signal: killed)"}
}

// end ends the VM with ex (At now when unset); false if it had already
// ended.
func (v *fakeVM) end(ex qemu.Exit) bool {
	if ex.At.IsZero() {
		ex.At = time.Now()
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.exit != nil {
		return false
	}
	v.exit = &ex
	close(v.done)
	return true
}

// crash makes the VM die as QEMU killed from outside does.
func (v *fakeVM) crash() bool { return v.end(crashExit()) }

func (v *fakeVM) setHoldStop(hold bool) {
	v.mu.Lock()
	v.holdStop = hold
	v.mu.Unlock()
}

func (v *fakeVM) stopsKills() (stops, kills int) {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.stops, v.kills
}

func (v *fakeVM) Done() <-chan struct{} { return v.done }

func (v *fakeVM) Exit() (qemu.Exit, bool) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.exit == nil {
		return qemu.Exit{}, false
	}
	return *v.exit, true
}

// Stop powers the guest off at once (exit 0), or with holdStop waits for
// another end; with NoACPI it ends as QEMU told to quit (killed, as package
// qemu classifies it). The state dir is cleaned as package qemu does.
func (v *fakeVM) Stop(ctx context.Context, opts qemu.StopOptions) (qemu.Exit, error) {
	v.mu.Lock()
	v.stops++
	v.stopOpts = append(v.stopOpts, opts)
	if v.stops == 1 {
		close(v.stopCalled)
	}
	hold := v.holdStop
	v.mu.Unlock()
	if opts.NoACPI {
		v.end(qemu.Exit{Class: qemu.ExitKilled, ExitCode: qemu.ExitCodeKilled, Reason: "stopped at once: QEMU told to quit"})
	}
	if hold {
		select {
		case <-v.done:
		case <-ctx.Done():
			v.end(qemu.Exit{Class: qemu.ExitKilled, ExitCode: qemu.ExitCodeKilled, Reason: "QEMU killed (SIGKILL) by the supervisor"})
		}
	}
	v.end(qemu.Exit{Class: qemu.ExitGuestShutdown, ExitCode: qemu.ExitCodeGuestShutdown, Reason: "guest powered off"})
	ex, _ := v.Exit()
	if err := qemu.CleanStateDir(v.dir, opts.Keep); err != nil {
		return ex, fmt.Errorf("fake stop: %w", err)
	}
	return ex, nil
}

func (v *fakeVM) stopOptions() []qemu.StopOptions {
	v.mu.Lock()
	defer v.mu.Unlock()
	return slices.Clone(v.stopOpts)
}

func (v *fakeVM) Kill() {
	v.mu.Lock()
	v.kills++
	v.mu.Unlock()
	v.end(qemu.Exit{Class: qemu.ExitKilled, ExitCode: qemu.ExitCodeKilled, Reason: "QEMU killed (SIGKILL) by the supervisor"})
}

func (v *fakeVM) Detach() {
	v.mu.Lock()
	v.detached = true
	v.mu.Unlock()
}

func (v *fakeVM) Pid() int                    { return v.pid }
func (v *fakeVM) StateDir() string            { return v.dir }
func (v *fakeVM) StartTimes() qemu.StartTimes { return v.startTimes }

func (v *fakeVM) Stats() (qemu.ProcStats, error) {
	if _, ended := v.Exit(); ended {
		return qemu.ProcStats{}, fmt.Errorf("stats of fake VM pid %d: it ended", v.pid)
	}
	return qemu.ProcStats{At: time.Now()}, nil
}

// errNoGuest: a fake VM has no guest to reach.
var errNoGuest = errors.New("fake VM: no guest")

func (v *fakeVM) GuestExec(context.Context, qemu.ExecRequest) (qemu.ExecResult, error) {
	if v.guestFromStart || (v.guestUp != nil && v.guestUp.Load()) {
		return qemu.ExecResult{}, nil
	}
	return qemu.ExecResult{}, errNoGuest
}

func (v *fakeVM) ForwardPort(context.Context, int, int) (int, error) { return 0, errNoGuest }
func (v *fakeVM) RemoveForward(context.Context, int) error           { return errNoGuest }

func (v *fakeVM) AttachConsole(context.Context) (io.ReadWriteCloser, error) {
	return nil, errNoGuest
}

func (v *fakeVM) QMP(context.Context, string, any, any) error { return errNoGuest }

func (v *fakeVM) DialDisplay(context.Context) (net.Conn, error) { return nil, errNoGuest }

func (v *fakeVM) SaveState(context.Context, string, func() error) (qemu.SavedState, error) {
	return qemu.SavedState{}, errNoGuest
}
