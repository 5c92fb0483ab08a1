package qemu

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/digitalocean/go-qemu/qmp"
	"github.com/go-logr/logr"
	"golang.org/x/sys/unix"
)

// Start launches QEMU for spec with its state in stateDir (created 0700;
// must not hold a live VM) and returns once QMP is connected. The context
// bounds only the start-up; the VM keeps running after ctx ends and after
// this process exits.
//
// An existing console.log is kept as console.previous.log (for "logs
// --previous"); a stale exit record and sockets are removed.
//
// Its steps: the spec checked (startSpec), the state dir prepared
// (prepareStateDir), the process launched (launch), QMP connected and a
// restored guest let run (handshake), supervision started and a guest
// launched paused released (release).
func Start(ctx context.Context, spec Spec, stateDir string) (*VM, error) {
	begin := time.Now()
	spec, err := startSpec(spec, stateDir)
	if err != nil {
		return nil, err
	}
	log := logr.FromContextOrDiscard(ctx).WithValues("vm", spec.Name, "stateDir", spec.StateDir)
	if err := prepareStateDir(spec); err != nil {
		return nil, err
	}
	vm, err := launch(spec, log)
	if err != nil {
		return nil, err
	}
	vm.starts.Begin = begin
	if err := vm.handshake(ctx); err != nil {
		return nil, fmt.Errorf("start VM %s: %w%s", spec.Name, err, qemuLogTail(spec.Path(QEMULogName)))
	}
	go vm.supervise()
	if spec.Nice > 0 && spec.Incoming == "" {
		// Launched paused (-S).
		if err := vm.release(ctx); err != nil {
			// Supervised now: its exit record and cgroup are the
			// supervisor's once QEMU is gone.
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

// startSpec is spec made ready to start in stateDir: its state dir
// absolute, validated, defaults applied and its input files checked.
func startSpec(spec Spec, stateDir string) (Spec, error) {
	abs, err := filepath.Abs(stateDir)
	if err != nil {
		return spec, fmt.Errorf("state dir %q: %w", stateDir, err)
	}
	spec.StateDir = abs
	if err := spec.Validate(); err != nil {
		return spec, fmt.Errorf("invalid VM spec: %w", err)
	}
	spec = spec.withDefaults()
	if err := checkFiles(spec); err != nil {
		return spec, fmt.Errorf("start VM %s: %w", spec.Name, err)
	}
	return spec, nil
}

// undoStack holds what a failed step must undo, last done first undone.
type undoStack []func()

func (u *undoStack) push(f func()) { *u = append(*u, f) }

// unwind runs the undo steps, newest first, and forgets them.
func (u *undoStack) unwind() {
	for i := len(*u) - 1; i >= 0; i-- {
		(*u)[i]()
	}
	*u = nil
}

// launch starts the QEMU process of spec (its state dir prepared) in its
// own process group, as spec.RunAs and in spec.Cgroup when set, and
// returns its VM, whose childDone closes when the process exits. On
// failure nothing is left behind: what was done is undone, newest first
// (the process killed and reaped, the VM's cgroup removed).
func launch(spec Spec, log logr.Logger) (_ *VM, err error) {
	var undo undoStack
	defer func() {
		if err != nil {
			undo.unwind()
		}
	}()
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
	cmd.Dir = spec.StateDir
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
		undo.push(func() { _ = removeCgroup(spec) }) // also what was made before a failure
		if cgDirs, err = prepareCgroup(spec); err != nil {
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
		hint := ""
		if spec.RunAs != nil && errors.Is(err, os.ErrPermission) {
			hint = fmt.Sprintf(" (as uid %d gid %d: the caller needs CAP_SETUID and CAP_SETGID)", spec.RunAs.UID, spec.RunAs.GID)
		}
		return nil, fmt.Errorf("start %s: %w%s", spec.QEMUBinary, err, hint)
	}
	undo.push(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	if spec.Cgroup != nil && !cmd.SysProcAttr.UseCgroupFD {
		// cgroup v1: moved right after the fork, before QMP is up.
		if err := moveToCgroup(cgDirs, cmd.Process.Pid); err != nil {
			return nil, fmt.Errorf("start VM %s: %w", spec.Name, err)
		}
	}
	log.V(2).Info("QEMU started", "pid", cmd.Process.Pid)
	vm := newVM(spec, spec.StateDir, cmd.Process.Pid, log)
	vm.starts.Exec = time.Now()
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
	return vm, nil
}

// handshake connects QMP to a freshly launched QEMU and, for a restored
// guest (spec.Incoming), lowers its threads to spec.Nice and lets it run.
// On failure QEMU is killed: no half-started QEMU stays behind.
func (vm *VM) handshake(ctx context.Context) error {
	err := vm.connect(ctx)
	vm.starts.QMP = time.Now()
	if err == nil && vm.spec.Nice > 0 && vm.spec.Incoming != "" {
		// The restored guest runs as soon as its state is loaded: lower
		// every thread first.
		err = reniceProcess(vm.pid, vm.spec.Nice)
	}
	if err == nil && vm.spec.Incoming != "" {
		err = vm.finishIncoming(ctx) // lets the restored guest run
	}
	if err != nil {
		if vm.mon != nil {
			vm.mon.Disconnect()
		}
		_ = signalPid(vm.pid, syscall.SIGKILL)
		select {
		case <-vm.childDone:
			vm.removeCgroup()
		case <-time.After(5 * time.Second):
		}
	}
	return err
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
