package qemu

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/digitalocean/go-qemu/qmp"
	"github.com/go-logr/logr"
)

// VM is one supervised QEMU process. It is created by Start or Adopt; QEMU
// runs in its own process group and outlives this process. All methods are safe
// for concurrent use.
type VM struct {
	spec     Spec
	stateDir string
	pid      int
	log      logr.Logger

	// child is non-nil when QEMU is our child: its exit status is known.
	childDone   chan struct{}
	childStatus string

	mon *qmp.SocketMonitor

	consoleMu      sync.Mutex
	consoleConn    net.Conn
	consoleClients map[*consoleClient]struct{}

	mu       sync.Mutex
	state    State
	cause    cause
	exit     *Exit
	subs     map[chan Event]struct{}
	forcing  string // why we are quitting/killing QEMU, for classification
	done     chan struct{}
	closed   bool
	lastStat string

	// qmpSlot holds our one QMP command in flight (qmp.go); detached is
	// closed by Detach.
	qmpSlot  chan struct{}
	detached chan struct{}

	// agent is the guest-agent client (qga.go), made on first use.
	agentOnce sync.Once
	agent     *guestAgent

	// starts: when Start reached its steps (zero for an adopted VM);
	// written by Start before it returns the VM.
	starts StartTimes
}

// StartTimes are the wall-clock steps of Start: where a slow start spent
// its time (the burst benchmark's per-pod timeline). Begin is zero for a
// VM Adopt found.
type StartTimes struct {
	// Begin: Start was called. Exec: the QEMU process was started (the
	// state dir prepared, fork and exec done). Socket: the first dial of
	// the QMP socket that succeeded (QEMU created its chardevs). QMP: the
	// greeting was read and capabilities negotiated. Released: the vCPUs
	// were released (renice and cont with a nice value, or the incoming
	// snapshot loaded): Start returns right after.
	Begin, Exec, Socket, QMP, Released time.Time
	// Dials is the number of dials of the QMP socket (20 ms apart).
	Dials int
}

// StartTimes returns the steps of the Start that made vm.
func (vm *VM) StartTimes() StartTimes { return vm.starts }

func newVM(spec Spec, dir string, pid int, log logr.Logger) *VM {
	return &VM{spec: spec, stateDir: dir, pid: pid, log: log, state: StateStarting,
		subs: map[chan Event]struct{}{}, done: make(chan struct{}),
		qmpSlot: make(chan struct{}, 1), detached: make(chan struct{})}
}

// State is the current life-cycle state.
func (vm *VM) State() State {
	vm.mu.Lock()
	defer vm.mu.Unlock()
	return vm.state
}

// Exit returns how the VM ended, once it has.
func (vm *VM) Exit() (Exit, bool) {
	vm.mu.Lock()
	defer vm.mu.Unlock()
	if vm.exit == nil {
		return Exit{}, false
	}
	return *vm.exit, true
}

// Done is closed when QEMU has exited and the exit is recorded.
func (vm *VM) Done() <-chan struct{} { return vm.done }

// Wait blocks until the VM exits or ctx ends.
func (vm *VM) Wait(ctx context.Context) (Exit, error) {
	select {
	case <-vm.done:
		ex, _ := vm.Exit()
		return ex, nil
	case <-ctx.Done():
		return Exit{}, ctx.Err()
	}
}

// Pid is QEMU's process id.
func (vm *VM) Pid() int { return vm.pid }

// Stats returns the QEMU process's CPU time and resident memory.
func (vm *VM) Stats() (ProcStats, error) {
	if !qemuAlive(vm.pid, vm.stateDir) {
		return ProcStats{}, fmt.Errorf("stats of VM %s: QEMU is not running", vm.spec.Name)
	}
	return readProcStats(vm.pid)
}

// StateDir is the VM's state directory.
func (vm *VM) StateDir() string { return vm.stateDir }

// Spec is the spec the VM was started with.
func (vm *VM) Spec() Spec { return vm.spec }

// Detach stops supervising without touching QEMU (e.g. the caller is
// shutting down); Adopt picks the VM up again. Event subscriptions are
// closed, and QMP commands (one possibly still waiting for a reply) end.
func (vm *VM) Detach() {
	vm.mu.Lock()
	if vm.closed || vm.exit != nil {
		vm.mu.Unlock()
		return
	}
	vm.closed = true
	close(vm.detached)
	for ch := range vm.subs {
		close(ch)
		delete(vm.subs, ch)
	}
	vm.mu.Unlock()
	if vm.mon != nil {
		vm.mon.Disconnect()
	}
}

// QMP runs a QMP command and decodes its "return" into out (may be nil).
func (vm *VM) QMP(ctx context.Context, command string, args any, out any) error {
	c := map[string]any{"execute": command}
	if args != nil {
		c["arguments"] = args
	}
	b, err := vm.run(ctx, c)
	if err != nil {
		return fmt.Errorf("QMP %s: %w", command, err)
	}
	if out == nil {
		return nil
	}
	var r struct {
		Return json.RawMessage `json:"return"`
	}
	if err := json.Unmarshal(b, &r); err != nil {
		return fmt.Errorf("QMP %s: decode reply: %w", command, err)
	}
	if err := json.Unmarshal(r.Return, out); err != nil {
		return fmt.Errorf("QMP %s: decode return: %w", command, err)
	}
	return nil
}

// queryStatus returns QEMU's run state (decoded into our own struct: the
// generated raw types reject run states newer than QEMU 2.11).
func (vm *VM) queryStatus(ctx context.Context) (string, error) {
	var st struct {
		Status string `json:"status"`
	}
	if err := vm.QMP(ctx, "query-status", nil, &st); err != nil {
		return "", err
	}
	return st.Status, nil
}

// RunState returns QEMU's own run state ("running", "paused", "shutdown",
// "guest-panicked", ...).
func (vm *VM) RunState(ctx context.Context) (string, error) { return vm.queryStatus(ctx) }

func vmLogger(ctx context.Context) logr.Logger { return logr.FromContextOrDiscard(ctx) }
