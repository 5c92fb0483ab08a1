package qemu

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/digitalocean/go-qemu/qmp"
	"github.com/go-logr/logr"
	"golang.org/x/sys/unix"
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

// Start launches QEMU for spec with its state in stateDir (created 0700;
// must not hold a live VM) and returns once QMP is connected. The context
// bounds only the start-up; the VM keeps running after ctx ends and after
// this process exits.
//
// An existing console.log is kept as console.previous.log (for "logs
// --previous"); a stale exit record and sockets are removed.
func Start(ctx context.Context, spec Spec, stateDir string) (*VM, error) {
	begin := time.Now()
	abs, err := filepath.Abs(stateDir)
	if err != nil {
		return nil, fmt.Errorf("state dir %q: %w", stateDir, err)
	}
	spec.StateDir = abs
	if err := spec.Validate(); err != nil {
		return nil, fmt.Errorf("invalid VM spec: %w", err)
	}
	spec = spec.withDefaults()
	log := logr.FromContextOrDiscard(ctx).WithValues("vm", spec.Name, "stateDir", abs)

	if err := checkFiles(spec); err != nil {
		return nil, fmt.Errorf("start VM %s: %w", spec.Name, err)
	}
	if err := os.MkdirAll(abs, 0o700); err != nil {
		return nil, fmt.Errorf("create state dir: %w", err)
	}
	if err := os.Chmod(abs, 0o700); err != nil {
		return nil, fmt.Errorf("chmod state dir: %w", err)
	}
	if pid, err := readPidfile(abs); err == nil && qemuAlive(pid, abs) {
		return nil, fmt.Errorf("state dir %s: QEMU pid %d is still running there (use Adopt)", abs, pid)
	}
	for _, n := range []string{QMPSocketName, ConsoleSocketName, GuestAgentSocketName, PidfileName, ExitFileName, MigrateSocketName, VNCSocketName} {
		if err := os.Remove(spec.Path(n)); err != nil && !errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("remove stale %s: %w", n, err)
		}
	}
	if _, err := os.Stat(spec.Path(ConsoleLogName)); err == nil {
		if err := os.Rename(spec.Path(ConsoleLogName), spec.Path(ConsolePreviousLogName)); err != nil {
			return nil, fmt.Errorf("keep previous console log: %w", err)
		}
		os.Remove(spec.Path(ConsoleLogName + ".1"))
	}
	if spec.Firmware == FirmwareUEFI {
		if _, err := os.Stat(spec.Path(UEFIVarsName)); errors.Is(err, os.ErrNotExist) {
			if err := copyFile(spec.UEFIVarsTemplate, spec.Path(UEFIVarsName)); err != nil {
				return nil, fmt.Errorf("copy UEFI vars: %w", err)
			}
		}
	}
	specJSON, _ := json.MarshalIndent(spec, "", "  ")
	if err := writeFileAtomic(spec.Path(SpecFileName), specJSON, 0o600); err != nil {
		return nil, err
	}
	qlog, err := os.OpenFile(spec.Path(QEMULogName), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open QEMU log: %w", err)
	}
	defer qlog.Close()
	devnull, err := os.Open(os.DevNull)
	if err != nil {
		return nil, err
	}
	defer devnull.Close()

	args := Args(spec)
	// Not CommandContext: QEMU must outlive ctx.
	cmd := exec.Command(spec.QEMUBinary, args...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = devnull, qlog, qlog
	if spec.Incoming != "" {
		// Opened by us and inherited as IncomingFD: QEMU (perhaps another
		// user) needs no access to the file itself.
		in, err := os.Open(spec.Incoming)
		if err != nil {
			return nil, fmt.Errorf("start VM %s: incoming state: %w", spec.Name, err)
		}
		defer in.Close()
		cmd.ExtraFiles = []*os.File{in}
	}
	cmd.Dir = abs
	// Own process group: no signal aimed at our group (a Ctrl-C, a kill of
	// our group) reaches QEMU, and it survives our death. Our session, not
	// one of its own: see lowerAutogroup.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if spec.RunAs != nil {
		if err := handOver(spec); err != nil {
			return nil, fmt.Errorf("start VM %s as uid %d gid %d: %w", spec.Name, spec.RunAs.UID, spec.RunAs.GID, err)
		}
		cmd.SysProcAttr.Credential = spec.credential()
	}
	var cgDirs []cgroupDir
	if spec.Cgroup != nil {
		if cgDirs, err = prepareCgroup(spec); err != nil {
			_ = removeCgroup(spec) // what was made before the failure
			return nil, fmt.Errorf("start VM %s: %w", spec.Name, err)
		}
		fd, err := openCgroupV2(cgDirs)
		if err != nil {
			return nil, fmt.Errorf("start VM %s: %w", spec.Name, err)
		}
		if fd >= 0 {
			defer unix.Close(fd)
			cmd.SysProcAttr.UseCgroupFD, cmd.SysProcAttr.CgroupFD = true, fd
		}
	}
	fmt.Fprintf(qlog, "=== %s start: %s %s\n", time.Now().UTC().Format(time.RFC3339Nano), spec.QEMUBinary, strings.Join(args, " "))
	ns := ""
	if spec.Cgroup != nil {
		ns = spec.Cgroup.Namespace
	}
	if err := startConfined(cmd, ns, spec.RunAs != nil); err != nil {
		if spec.Cgroup != nil {
			_ = removeCgroup(spec)
		}
		hint := ""
		if spec.RunAs != nil && errors.Is(err, os.ErrPermission) {
			hint = fmt.Sprintf(" (as uid %d gid %d: the caller needs CAP_SETUID and CAP_SETGID)", spec.RunAs.UID, spec.RunAs.GID)
		}
		return nil, fmt.Errorf("start %s: %w%s", spec.QEMUBinary, err, hint)
	}
	if spec.Cgroup != nil && !cmd.SysProcAttr.UseCgroupFD {
		// cgroup v1: moved right after the fork, before QMP is up.
		if err := moveToCgroup(cgDirs, cmd.Process.Pid); err != nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
			_ = removeCgroup(spec)
			return nil, fmt.Errorf("start VM %s: %w", spec.Name, err)
		}
	}
	log.V(2).Info("QEMU started", "pid", cmd.Process.Pid)
	vm := newVM(spec, abs, cmd.Process.Pid, log)
	vm.starts.Begin, vm.starts.Exec = begin, time.Now()
	vm.childDone = make(chan struct{})
	go func() {
		err := cmd.Wait()
		st := "exit status 0"
		if err != nil {
			st = err.Error()
		}
		vm.mu.Lock()
		vm.childStatus = st
		vm.mu.Unlock()
		close(vm.childDone)
	}()

	err = vm.connect(ctx)
	vm.starts.QMP = time.Now()
	if err == nil && spec.Nice > 0 && spec.Incoming != "" {
		// The restored guest runs as soon as its state is loaded: lower
		// every thread first.
		err = reniceProcess(vm.pid, spec.Nice)
	}
	if err == nil && spec.Incoming != "" {
		err = vm.finishIncoming(ctx) // lets the restored guest run
	}
	if err != nil {
		// Do not leave a half-started QEMU behind.
		if vm.mon != nil {
			vm.mon.Disconnect()
		}
		_ = signalPid(vm.pid, syscall.SIGKILL)
		select {
		case <-vm.childDone:
			vm.removeCgroup()
		case <-time.After(5 * time.Second):
		}
		return nil, fmt.Errorf("start VM %s: %w%s", spec.Name, err, qemuLogTail(spec.Path(QEMULogName)))
	}
	go vm.supervise()
	if spec.Nice > 0 && spec.Incoming == "" {
		// Launched paused (-S).
		if err := vm.release(ctx); err != nil {
			_ = signalPid(vm.pid, syscall.SIGKILL)
			select {
			case <-vm.done:
			case <-time.After(10 * time.Second):
			}
			return nil, fmt.Errorf("start VM %s: %w", spec.Name, err)
		}
	}
	vm.holdGuestAgent()
	vm.starts.Released = time.Now()
	return vm, nil
}

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

func newVM(spec Spec, dir string, pid int, log logr.Logger) *VM {
	return &VM{spec: spec, stateDir: dir, pid: pid, log: log, state: StateStarting,
		subs: map[chan Event]struct{}{}, done: make(chan struct{}),
		qmpSlot: make(chan struct{}, 1), detached: make(chan struct{})}
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

// connect waits for the QMP socket and negotiates capabilities.
func (vm *VM) connect(ctx context.Context) error {
	sock := vm.spec.Path(QMPSocketName)
	deadline, ok := ctx.Deadline()
	if !ok {
		deadline = time.Now().Add(30 * time.Second)
	}
	var lastErr error
	for {
		if vm.childDone != nil {
			select {
			case <-vm.childDone:
				vm.mu.Lock()
				st := vm.childStatus
				vm.mu.Unlock()
				return fmt.Errorf("QEMU exited during start-up (%s)", st)
			default:
			}
		}
		mon, err := qmp.NewSocketMonitor("unix", sock, 2*time.Second)
		vm.starts.Dials++
		if err == nil {
			if vm.starts.Socket.IsZero() {
				vm.starts.Socket = time.Now()
			}
			if err = connectWithTimeout(mon, time.Until(deadline)); err == nil {
				vm.mon = mon
				if vm.pid == 0 {
					vm.pid, _ = readPidfile(vm.stateDir)
				}
				vm.mu.Lock()
				if vm.state == StateStarting {
					vm.state = StateRunning
				}
				vm.mu.Unlock()
				return nil
			}
			mon.Disconnect()
		}
		lastErr = err
		if time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("connect QMP %s: %w", sock, errors.Join(lastErr, ctx.Err()))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// connectWithTimeout bounds go-qemu's Connect, which reads the greeting
// without a deadline: QEMU serves one QMP client at a time, so while another
// supervisor is still connected the greeting never comes.
func connectWithTimeout(mon *qmp.SocketMonitor, d time.Duration) error {
	if d < time.Second {
		d = time.Second
	}
	errc := make(chan error, 1)
	go func() { errc <- mon.Connect() }()
	select {
	case err := <-errc:
		return err
	case <-time.After(d):
		mon.Disconnect()
		<-errc
		return fmt.Errorf("no QMP greeting within %s (is another supervisor connected?)", d.Round(time.Millisecond))
	}
}

// supervise drains QMP events (go-qemu's channel is unbuffered: an undrained
// channel blocks command replies), keeps the state, turns guest shutdown and
// panic into an exit, and records the exit when QEMU goes away.
func (vm *VM) supervise() {
	events, _ := vm.mon.Events(context.Background())
	capTicker := time.NewTicker(consoleCapCheckInterval)
	defer capTicker.Stop()
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
	vm.log.V(2).Info("VM event", "event", fmt.Sprintf("%T", ev))
	if quit {
		// With -action shutdown=pause,panic=pause QEMU waits for us: quit it
		// now that the cause is known. Asynchronously: Run needs this
		// goroutine to keep draining events.
		go vm.quit()
	}
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

// StopOptions control Stop.
type StopOptions struct {
	// Grace is how long the guest gets to power off after the ACPI power
	// button before QEMU is told to quit (default 30s).
	Grace time.Duration
	// QuitGrace is how long `quit` gets before SIGKILL (default 5s).
	QuitGrace time.Duration
	// Keep lists state-dir file names (globs) to keep; everything else in
	// the state dir is removed after QEMU is gone. Nil keeps nothing, and
	// the state dir itself is removed.
	Keep []string
}

// Stop ends the VM gracefully: ACPI power button (system_powerdown), wait up
// to Grace for the guest to power off, then QMP quit, then SIGKILL. It then
// cleans the state dir down to opts.Keep. Safe to call on an exited VM (it
// only cleans) and repeatedly. If ctx ends early the remaining steps are
// skipped straight to SIGKILL.
func (vm *VM) Stop(ctx context.Context, opts StopOptions) (Exit, error) {
	if opts.Grace <= 0 {
		opts.Grace = 30 * time.Second
	}
	if opts.QuitGrace <= 0 {
		opts.QuitGrace = 5 * time.Second
	}
	if _, exited := vm.Exit(); !exited {
		graceEnd := time.Now().Add(opts.Grace)
		pctx, cancel := context.WithDeadline(ctx, graceEnd) // a hung QMP must not hold the stop
		if err := vm.QMP(pctx, "system_powerdown", nil, nil); err != nil {
			vm.log.V(1).Info("system_powerdown failed", "err", err)
		}
		cancel()
		if !vm.waitDone(ctx, time.Until(graceEnd)) {
			vm.setForcing(fmt.Sprintf("guest did not power off within %s of the ACPI power button; quit", opts.Grace))
			qctx, cancel := context.WithTimeout(ctx, opts.QuitGrace)
			_ = vm.QMP(qctx, "quit", nil, nil)
			cancel()
			if !vm.waitDone(ctx, opts.QuitGrace) {
				vm.Kill()
				// Not bounded by ctx: once we kill, we wait for the exit
				// record so nothing is left half-stopped.
				if !vm.waitDone(context.Background(), 30*time.Second) {
					return Exit{}, fmt.Errorf("stop VM %s: QEMU pid %d still alive after SIGKILL", vm.spec.Name, vm.pid)
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

// CleanStateDir removes everything in dir except names matching keep
// (filepath.Match patterns); with no keep the dir itself goes.
func CleanStateDir(dir string, keep []string) error {
	if len(keep) == 0 {
		if err := os.RemoveAll(dir); err != nil {
			return fmt.Errorf("remove state dir %s: %w", dir, err)
		}
		return nil
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		return fmt.Errorf("clean state dir %s: %w", dir, err)
	}
	var errs []error
	for _, e := range ents {
		kept := false
		for _, k := range keep {
			if ok, _ := filepath.Match(k, e.Name()); ok {
				kept = true
				break
			}
		}
		if !kept {
			if err := os.RemoveAll(filepath.Join(dir, e.Name())); err != nil {
				errs = append(errs, err)
			}
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("clean state dir %s: %w", dir, err)
	}
	return nil
}

// checkFiles reports missing or unusable input files before QEMU runs, so
// the error names the spec field.
func checkFiles(s Spec) error {
	var errs []error
	check := func(what, p string) {
		if p == "" {
			return
		}
		fi, err := os.Stat(p)
		switch {
		case err != nil:
			errs = append(errs, fmt.Errorf("%s: %w", what, err))
		case !fi.Mode().IsRegular():
			errs = append(errs, fmt.Errorf("%s %s: not a regular file", what, p))
		}
	}
	check("kernel", s.Kernel)
	check("initrd", s.Initrd)
	check("incoming state", s.Incoming)
	if s.Firmware == FirmwareUEFI {
		check("uefi code", s.UEFICode)
		check("uefi vars template", s.UEFIVarsTemplate)
	}
	for i, d := range s.Disks {
		check(fmt.Sprintf("disk[%d]", i), d.Path)
	}
	return errors.Join(errs...)
}

func copyFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

func qemuLogTail(path string) string {
	b, err := os.ReadFile(path)
	if err != nil || len(b) == 0 {
		return ""
	}
	if len(b) > 2000 {
		b = b[len(b)-2000:]
	}
	return "; QEMU log: " + strings.TrimSpace(string(b))
}

// FreeLoopbackPort returns a TCP port on 127.0.0.1 that was free a moment
// ago (the kernel picks it).
func FreeLoopbackPort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("find free loopback port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// ForwardPort forwards 127.0.0.1:hostPort to guestPort at runtime (HMP
// hostfwd_add via QMP human-monitor-command). hostPort 0 picks a free port:
// the port is free when picked but QEMU binds it a moment later, so a port
// taken in between (another forward, any process on the host) is retried
// with a new one, up to forwardPortTries times. Returns the host port.
func (vm *VM) ForwardPort(ctx context.Context, guestPort, hostPort int) (int, error) {
	if !vm.spec.Network {
		return 0, fmt.Errorf("forward guest port %d: VM %s has no network", guestPort, vm.spec.Name)
	}
	if guestPort < 1 || guestPort > 65535 || hostPort < 0 || hostPort > 65535 {
		return 0, fmt.Errorf("forward guest port %d to host port %d: port out of range", guestPort, hostPort)
	}
	add := func(hp int) (bool, error) { return vm.hostfwdAdd(ctx, hp, guestPort) }
	if hostPort != 0 {
		_, err := add(hostPort)
		if err != nil {
			return 0, err
		}
		return hostPort, nil
	}
	return forwardFreePort(forwardPortTries, FreeLoopbackPort, add)
}

// forwardFreePort picks a free port and adds a forward on it, picking again
// while add reports the port refused (taken since it was picked), up to
// tries picks; any other error ends it at once.
func forwardFreePort(tries int, pick func() (int, error), add func(hostPort int) (refused bool, err error)) (int, error) {
	var err error
	for range tries {
		hp, perr := pick()
		if perr != nil {
			return 0, perr
		}
		var refused bool
		if refused, err = add(hp); err == nil {
			return hp, nil
		} else if !refused {
			return 0, err
		}
	}
	return 0, fmt.Errorf("%w (%d free ports tried)", err, tries)
}

// forwardPortTries bounds ForwardPort's picks of a free host port.
const forwardPortTries = 5

// hostfwdAdd adds the forward; refused is QEMU's own refusal (it could not
// bind the host port), as opposed to a failed QMP call.
func (vm *VM) hostfwdAdd(ctx context.Context, hostPort, guestPort int) (refused bool, err error) {
	var out string
	cmd := fmt.Sprintf("hostfwd_add net0 tcp:127.0.0.1:%d-:%d", hostPort, guestPort)
	if err := vm.QMP(ctx, "human-monitor-command", map[string]any{"command-line": cmd}, &out); err != nil {
		return false, fmt.Errorf("forward guest port %d: %w", guestPort, err)
	}
	if s := strings.TrimSpace(out); s != "" {
		return true, fmt.Errorf("forward guest port %d to 127.0.0.1:%d: %s", guestPort, hostPort, s)
	}
	return false, nil
}

// RemoveForward removes a runtime or start-time forward of hostPort.
func (vm *VM) RemoveForward(ctx context.Context, hostPort int) error {
	var out string
	cmd := fmt.Sprintf("hostfwd_remove net0 tcp:127.0.0.1:%d", hostPort)
	if err := vm.QMP(ctx, "human-monitor-command", map[string]any{"command-line": cmd}, &out); err != nil {
		return fmt.Errorf("remove forward of host port %d: %w", hostPort, err)
	}
	if s := strings.TrimSpace(out); s != "" && !strings.Contains(s, "removed") {
		return fmt.Errorf("remove forward of host port %d: %s", hostPort, s)
	}
	return nil
}

func vmLogger(ctx context.Context) logr.Logger { return logr.FromContextOrDiscard(ctx) }

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
