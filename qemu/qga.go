package qemu

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"
	"syscall"
	"time"
)

// The host side of qemu-guest-agent (QGA). Every VM has a virtio-serial
// port named GuestAgentChannel whose host end is the unix socket
// GuestAgentSocketName in the state dir (0700, owned by the QEMU user: only
// that user and root reach it). A guest that runs qemu-guest-agent on that
// port answers JSON commands on it; a guest that does not leaves the port
// closed and nothing ever answers.
//
// Protocol: one JSON command per line, one JSON reply per line. Before each
// command the client sends guest-sync-delimited with a fresh id, prefixed by
// 0xFF (the agent drops any half-read input on it); the agent answers 0xFF
// then {"return": id}. The client skips everything up to the answer with its
// id, so replies left over from an earlier, abandoned command (a timeout, a
// restarted agent) are never taken for the answer to this one. The sync is
// bounded by a short handshake timeout: when it passes, the guest is taken
// to run no agent.
//
// guest-exec is not interactive: the command (path and argv, no shell) runs
// with its whole stdin given up front (input-data), its output captured, and
// guest-exec-status is polled until it exited, which returns the exit code
// and the output. QGA has no command to kill what guest-exec started: a
// command that outlives its caller's timeout keeps running in the guest.
//
// Concurrency: the agent owns one connection (QEMU's chardev serves one
// client at a time); one command (sync + command + reply) at a time holds
// slot, so several execs (kubectl exec, exec probes) interleave their polls
// on the one connection. A failed transaction (timeout, malformed reply,
// closed socket) drops the connection; the next one dials again.

// Limits of GuestExec.
const (
	// MaxExecStdin bounds the stdin of one guest exec: it travels base64
	// encoded in one JSON command.
	MaxExecStdin = 1 << 20
	// MaxExecOutput bounds each of stdout and stderr of one guest exec: the
	// agent returns them in one reply, which is refused beyond that.
	MaxExecOutput = 1 << 20
	// DefaultGuestAgentHandshake bounds the guest-sync-delimited handshake.
	DefaultGuestAgentHandshake = 5 * time.Second
)

var (
	// ErrGuestAgentNotResponding: the guest-agent channel is there but
	// nothing answered the handshake in time.
	ErrGuestAgentNotResponding = errors.New("guest agent not responding")
	// ErrNoGuestAgentChannel: the VM has no guest-agent socket (started by
	// an older qemu-kubelet, or gone).
	ErrNoGuestAgentChannel = errors.New("the VM has no guest agent channel")
	// ErrExecOutputTooLarge: the command's output exceeds MaxExecOutput.
	ErrExecOutputTooLarge = fmt.Errorf("exec output exceeds %d bytes per stream", MaxExecOutput)
	// ErrExecStdinTooLarge: the stdin given exceeds MaxExecStdin.
	ErrExecStdinTooLarge = fmt.Errorf("exec stdin exceeds %d bytes", MaxExecStdin)
	// errReplyTooLarge: a reply line longer than allowed.
	errReplyTooLarge = errors.New("guest agent reply too large")
)

// GuestAgentError is a command the agent refused (its error class and
// description), e.g. guest-exec of a program that does not exist.
type GuestAgentError struct {
	Command string
	Class   string
	Desc    string
}

func (e *GuestAgentError) Error() string {
	return fmt.Sprintf("guest agent: %s: %s (%s)", e.Command, e.Desc, e.Class)
}

// ExecRequest is one command to run in the guest: Path (looked up in the
// agent's PATH when it has no slash) with Args, no shell involved.
type ExecRequest struct {
	Path  string
	Args  []string
	Stdin []byte
}

// ExecResult is how a guest command ended.
type ExecResult struct {
	// ExitCode is the exit status, or 128+Signal when a signal killed it.
	ExitCode int
	// Signal is the signal that killed the command, 0 if it exited.
	Signal int
	Stdout []byte
	Stderr []byte
	// Truncated: the agent cut the output at its own limit (16 MiB).
	Truncated bool
}

// guestAgent is the client of one VM's agent channel (see above).
type guestAgent struct {
	name      string
	dial      func(ctx context.Context) (net.Conn, error)
	handshake time.Duration

	// slot is held by the one transaction in flight; its holder owns r
	// and nextID, and is the only one that sets conn.
	slot   chan struct{}
	r      *bufio.Reader
	nextID int64

	// mu guards conn and closed (close may run while a transaction holds
	// the slot: closing the conn ends its reads).
	mu     sync.Mutex
	conn   net.Conn
	closed bool
}

func newGuestAgent(name string, dial func(ctx context.Context) (net.Conn, error)) *guestAgent {
	return &guestAgent{name: name, dial: dial, handshake: DefaultGuestAgentHandshake,
		slot: make(chan struct{}, 1), nextID: time.Now().UnixNano() & (1<<40 - 1)}
}

// close drops the connection for good.
func (a *guestAgent) close() {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.closed = true
	if a.conn != nil {
		a.conn.Close()
		a.conn = nil
	}
}

// dropConn closes c if it is still the current connection.
func (a *guestAgent) dropConn(c net.Conn) {
	a.mu.Lock()
	defer a.mu.Unlock()
	c.Close()
	if a.conn == c {
		a.conn = nil
	}
}

// connLocked returns the connection, dialling when there is none. The
// caller holds the slot.
func (a *guestAgent) connLocked(ctx context.Context) (net.Conn, error) {
	a.mu.Lock()
	c, closed := a.conn, a.closed
	a.mu.Unlock()
	if closed {
		return nil, fmt.Errorf("guest agent of VM %s: %w", a.name, errVMExited)
	}
	if c != nil {
		return c, nil
	}
	c, err := a.dial(ctx)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) || errors.Is(err, syscall.ECONNREFUSED) {
			return nil, fmt.Errorf("VM %s: %w (it was started without one, e.g. by an older qemu-kubelet: restart the pod to get it): %v", a.name, ErrNoGuestAgentChannel, err)
		}
		return nil, fmt.Errorf("VM %s: connect to the guest agent channel: %w", a.name, err)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		c.Close()
		return nil, fmt.Errorf("guest agent of VM %s: %w", a.name, errVMExited)
	}
	a.conn = c
	a.r = bufio.NewReaderSize(c, 64<<10)
	return c, nil
}

// hold makes sure there is a connection (dials when there is none) and
// keeps it: see VM.holdGuestAgent. A transaction in flight holds one
// already; hold then returns at once.
func (a *guestAgent) hold(ctx context.Context) error {
	select {
	case a.slot <- struct{}{}:
	default:
		return nil
	}
	defer func() { <-a.slot }()
	_, err := a.connLocked(ctx)
	return err
}

// redial, with the slot held, dials again after a transaction dropped the
// connection, so that the port's host end stays open (VM.holdGuestAgent).
func (a *guestAgent) redial() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_, _ = a.connLocked(ctx)
}

// call runs one command: handshake, command, reply (at most maxReply bytes)
// decoded into out (may be nil).
func (a *guestAgent) call(ctx context.Context, command string, args any, out any, maxReply int) error {
	select {
	case a.slot <- struct{}{}:
	case <-ctx.Done():
		return fmt.Errorf("guest agent of VM %s: %s: waiting for the channel: %w", a.name, command, ctx.Err())
	}
	defer func() { <-a.slot }()
	c, err := a.connLocked(ctx)
	if err != nil {
		return err
	}
	// The context's end (a client gone, no deadline) ends a blocked read:
	// the connection is closed (dropped below).
	stop := context.AfterFunc(ctx, func() { c.Close() })
	err = a.transact(ctx, c, command, args, out, maxReply)
	var agentErr *GuestAgentError
	if !stop() || (err != nil && !errors.As(err, &agentErr)) {
		a.dropConn(c) // broken, or closed by the context's end
		a.redial()
	}
	if err != nil && ctx.Err() != nil && !errors.As(err, &agentErr) {
		return fmt.Errorf("guest agent of VM %s: %s: %w", a.name, command, ctx.Err())
	}
	return err
}

func (a *guestAgent) transact(ctx context.Context, c net.Conn, command string, args any, out any, maxReply int) error {
	hs := time.Now().Add(a.handshake)
	if dl, ok := ctx.Deadline(); ok && dl.Before(hs) {
		hs = dl
	}
	if ctx.Err() != nil {
		return ctx.Err()
	}
	c.SetDeadline(hs)
	if err := a.sync(c); err != nil {
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			return fmt.Errorf("%w on VM %s: no answer to the handshake within %s: the image runs no qemu-guest-agent on the %s virtio-serial port (or it has not started yet)",
				ErrGuestAgentNotResponding, a.name, a.handshake, GuestAgentChannel)
		}
		return fmt.Errorf("guest agent of VM %s: handshake: %w", a.name, err)
	}
	dl, _ := ctx.Deadline()
	if ctx.Err() != nil {
		return ctx.Err()
	}
	c.SetDeadline(dl)
	cmd := map[string]any{"execute": command}
	if args != nil {
		cmd["arguments"] = args
	}
	b, err := json.Marshal(cmd)
	if err != nil {
		return err
	}
	if _, err := c.Write(append(b, '\n')); err != nil {
		return fmt.Errorf("guest agent of VM %s: send %s: %w", a.name, command, err)
	}
	line, err := readLine(a.r, maxReply)
	if err != nil {
		return fmt.Errorf("guest agent of VM %s: reply to %s: %w", a.name, command, err)
	}
	var reply struct {
		Return json.RawMessage `json:"return"`
		Error  *struct {
			Class string `json:"class"`
			Desc  string `json:"desc"`
		} `json:"error"`
	}
	if err := json.Unmarshal(line, &reply); err != nil {
		return fmt.Errorf("guest agent of VM %s: malformed reply to %s: %w", a.name, command, err)
	}
	if reply.Error != nil {
		return &GuestAgentError{Command: command, Class: reply.Error.Class, Desc: reply.Error.Desc}
	}
	if reply.Return == nil {
		return fmt.Errorf("guest agent of VM %s: reply to %s has neither return nor error: %.200q", a.name, command, line)
	}
	if out != nil {
		if err := json.Unmarshal(reply.Return, out); err != nil {
			return fmt.Errorf("guest agent of VM %s: malformed return of %s: %w", a.name, command, err)
		}
	}
	return nil
}

// maxSkip bounds what the handshake skips looking for its answer.
const maxSkip = 1 << 20

// sync sends guest-sync-delimited with a fresh id and reads until the answer
// carrying that id (see the protocol above).
func (a *guestAgent) sync(c net.Conn) error {
	id := a.nextID
	a.nextID++
	b, _ := json.Marshal(map[string]any{"execute": "guest-sync-delimited", "arguments": map[string]any{"id": id}})
	if _, err := c.Write(append(append([]byte{0xFF}, b...), '\n')); err != nil {
		return err
	}
	skipped := 0
	for {
		for {
			ch, err := a.r.ReadByte()
			if err != nil {
				return err
			}
			if ch == 0xFF {
				break
			}
			if skipped++; skipped > maxSkip {
				return fmt.Errorf("more than %d bytes of unexpected data on the channel", maxSkip)
			}
		}
		line, err := readLine(a.r, 4096)
		if errors.Is(err, errReplyTooLarge) {
			continue
		}
		if err != nil {
			return err
		}
		skipped += len(line)
		var r struct {
			Return *int64 `json:"return"`
		}
		if json.Unmarshal(line, &r) == nil && r.Return != nil && *r.Return == id {
			return nil
		}
		if skipped > maxSkip {
			return fmt.Errorf("more than %d bytes of unexpected data on the channel", maxSkip)
		}
	}
}

// readLine reads up to and including '\n', failing with errReplyTooLarge
// (and the rest of the line unread) past max bytes.
func readLine(r *bufio.Reader, max int) ([]byte, error) {
	var buf []byte
	for {
		chunk, err := r.ReadSlice('\n')
		if len(buf)+len(chunk) > max {
			return nil, fmt.Errorf("%w (more than %d bytes)", errReplyTooLarge, max)
		}
		buf = append(buf, chunk...)
		if err == nil {
			return bytes.TrimRight(buf, "\r\n"), nil
		}
		if !errors.Is(err, bufio.ErrBufferFull) {
			return nil, err
		}
	}
}

// execStatus is guest-exec-status's return.
type execStatus struct {
	Exited       bool   `json:"exited"`
	ExitCode     *int   `json:"exitcode"`
	Signal       *int   `json:"signal"`
	OutData      string `json:"out-data"`
	ErrData      string `json:"err-data"`
	OutTruncated bool   `json:"out-truncated"`
	ErrTruncated bool   `json:"err-truncated"`
}

// maxStatusReply: two streams of MaxExecOutput base64-encoded, plus the
// rest of the reply.
const maxStatusReply = 2*(MaxExecOutput+2)/3*4 + 4096

// Polling guest-exec-status: from execPollMin, doubling up to execPollMax.
var (
	execPollMin = 10 * time.Millisecond
	execPollMax = 250 * time.Millisecond
)

// exec runs req in the guest until it exits or ctx ends.
func (a *guestAgent) exec(ctx context.Context, req ExecRequest) (ExecResult, error) {
	if req.Path == "" {
		return ExecResult{}, errors.New("exec: no command given")
	}
	for _, s := range append([]string{req.Path}, req.Args...) {
		if strings.ContainsRune(s, 0) {
			return ExecResult{}, fmt.Errorf("exec: argument %q contains a NUL byte", s)
		}
	}
	if len(req.Stdin) > MaxExecStdin {
		return ExecResult{}, ErrExecStdinTooLarge
	}
	args := map[string]any{"path": req.Path, "arg": append([]string{}, req.Args...), "capture-output": true}
	if len(req.Stdin) > 0 {
		args["input-data"] = base64.StdEncoding.EncodeToString(req.Stdin)
	}
	var started struct {
		PID *int64 `json:"pid"`
	}
	if err := a.call(ctx, "guest-exec", args, &started, 4096); err != nil {
		return ExecResult{}, err
	}
	if started.PID == nil {
		return ExecResult{}, fmt.Errorf("guest agent of VM %s: guest-exec returned no pid", a.name)
	}
	pid := *started.PID
	delay := execPollMin
	for {
		var st execStatus
		err := a.call(ctx, "guest-exec-status", map[string]any{"pid": pid}, &st, maxStatusReply)
		if errors.Is(err, errReplyTooLarge) {
			return ExecResult{}, fmt.Errorf("%s in VM %s: %w", req.Path, a.name, ErrExecOutputTooLarge)
		}
		if err != nil {
			return ExecResult{}, err
		}
		if st.Exited {
			return st.result(a.name)
		}
		t := time.NewTimer(delay)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return ExecResult{}, fmt.Errorf("%s (pid %d in VM %s) has not exited: %w (it keeps running in the guest: the guest agent cannot stop it)", req.Path, pid, a.name, ctx.Err())
		}
		delay = min(2*delay, execPollMax)
	}
}

func (st execStatus) result(vm string) (ExecResult, error) {
	res := ExecResult{Truncated: st.OutTruncated || st.ErrTruncated}
	var err error
	if res.Stdout, err = base64.StdEncoding.DecodeString(st.OutData); err != nil {
		return ExecResult{}, fmt.Errorf("guest agent of VM %s: stdout is not base64: %w", vm, err)
	}
	if res.Stderr, err = base64.StdEncoding.DecodeString(st.ErrData); err != nil {
		return ExecResult{}, fmt.Errorf("guest agent of VM %s: stderr is not base64: %w", vm, err)
	}
	if len(res.Stdout) > MaxExecOutput || len(res.Stderr) > MaxExecOutput {
		return ExecResult{}, fmt.Errorf("VM %s: %w", vm, ErrExecOutputTooLarge)
	}
	switch {
	case st.ExitCode != nil:
		res.ExitCode = *st.ExitCode
	case st.Signal != nil:
		res.Signal = *st.Signal
		res.ExitCode = 128 + *st.Signal
	default:
		return ExecResult{}, fmt.Errorf("guest agent of VM %s: exited command has neither exit code nor signal", vm)
	}
	return res, nil
}

// GuestExec runs a command in the guest through qemu-guest-agent (see the
// protocol notes in qga.go): stdin given whole, output and exit status
// returned once it exited. ctx bounds the whole run; a guest without an
// agent fails within DefaultGuestAgentHandshake with
// ErrGuestAgentNotResponding.
func (vm *VM) GuestExec(ctx context.Context, req ExecRequest) (ExecResult, error) {
	select {
	case <-vm.done:
		return ExecResult{}, fmt.Errorf("exec in VM %s: %w", vm.spec.Name, errVMExited)
	case <-vm.detached:
		return ExecResult{}, fmt.Errorf("exec in VM %s: %w", vm.spec.Name, errVMDetached)
	default:
	}
	return vm.guestAgent().exec(ctx, req)
}

// guestAgent returns the VM's guest-agent client, made on first use.
func (vm *VM) guestAgent() *guestAgent {
	vm.agentOnce.Do(func() {
		vm.agent = newGuestAgent(vm.spec.Name, func(ctx context.Context) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", vm.spec.Path(GuestAgentSocketName))
		})
		go func() { // the connection goes with the VM
			select {
			case <-vm.done:
			case <-vm.detached:
			}
			vm.agent.close()
		}()
	})
	return vm.agent
}

// holdGuestAgent connects to the guest-agent channel now, without sending
// anything, so that the host end of the virtio-serial port is open while
// the VM idles: qemu-guest-agent (7.2) polls a port whose host end is
// closed every 100 ms, which made an idle test-image VM cost about three
// times the host CPU (docs/performance.md, "CPU of an idle VM"). A VM
// whose QEMU has no channel (older state dirs) is left alone.
func (vm *VM) holdGuestAgent() {
	ctx, cancel := context.WithTimeout(context.Background(), DefaultGuestAgentHandshake)
	defer cancel()
	if err := vm.guestAgent().hold(ctx); err != nil {
		vm.log.V(1).Info("guest agent channel not held", "err", err.Error())
	}
}
