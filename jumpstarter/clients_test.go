package jumpstarter_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/jstest"
)

// Tests of the client classes: jstest's Serial and Power make the calls
// upstream's PySerialClient and PowerClient make (b1f2bb41).

// syncBuffer is an io.Writer the test reads while a client writes to it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
	ch chan struct{} // poked on every write
}

func newSyncBuffer() *syncBuffer { return &syncBuffer{ch: make(chan struct{}, 1)} }

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	select {
	case s.ch <- struct{}{}:
	default:
	}
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// waitFor waits until the buffer holds want.
func (s *syncBuffer) waitFor(ctx context.Context, t *testing.T, want string) {
	t.Helper()
	for !strings.Contains(s.String(), want) {
		select {
		case <-s.ch:
		case <-ctx.Done():
			t.Fatalf("waiting for %q in the output: %v; got %q", want, ctx.Err(), s.String())
		}
	}
}

// guestShell plays a guest's getty and shell on one console connection:
// a login prompt, a password prompt, then a shell that answers `echo X`
// with X, as a serial tty does (input echoed, CRLF line ends).
func guestShell(c net.Conn) {
	defer c.Close()
	w := func(s string) bool { _, err := io.WriteString(c, s); return err == nil }
	if !w("\r\nDebian GNU/Linux 12 vm-0 ttyS0\r\n\r\nvm-0 login: ") {
		return
	}
	sc := bufio.NewScanner(c)
	state := "login"
	for sc.Scan() {
		line := strings.TrimRight(sc.Text(), "\r")
		switch state {
		case "login":
			if !w(line + "\r\nPassword: ") {
				return
			}
			state = "password:" + line
		case "password:root":
			if line != "secret" {
				w("\r\nLogin incorrect\r\nvm-0 login: ")
				state = "login"
				continue
			}
			w("\r\nLinux vm-0 6.1.0-amd64\r\nroot@vm-0:~# ")
			state = "shell"
		case "shell":
			out := ""
			if arg, ok := strings.CutPrefix(line, "echo "); ok {
				out = arg + "\r\n"
			}
			if !w(line + "\r\n" + out + "root@vm-0:~# ") {
				return
			}
		default:
			w("\r\nLogin incorrect\r\nvm-0 login: ")
			state = "login"
		}
	}
}

// nextConsole is the guest side of the next console the exporter opened.
func nextConsole(ctx context.Context, t *testing.T, e *env) net.Conn {
	t.Helper()
	select {
	case c := <-e.target.consoles:
		return c
	case <-ctx.Done():
		t.Fatal("the exporter opened no console on the target")
		return nil
	}
}

// TestPySerialConsolePexpect: the console is a PySerialClient, and a test
// script's pexpect session logs in and runs a command, as upstream's QEMU
// driver test does (console.pexpect(); expect("login:"); sendline(...)).
func TestPySerialConsolePexpect(t *testing.T) {
	e, s, uuidOf := leasedSession(t, nil)
	ctx := ctxT(t, 30*time.Second)
	rep, err := s.GetReport(ctx)
	require.NoError(t, err)
	con, ok := jstest.FindDriver(rep, "console")
	require.True(t, ok)
	assert.Equal(t, "jumpstarter_driver_pyserial.client.PySerialClient", con.GetLabels()[jumpstarter.LabelClient])

	serial := s.Serial(uuidOf("console"))
	p, err := serial.Pexpect(ctx)
	require.NoError(t, err)
	defer p.Close()
	go guestShell(nextConsole(ctx, t, e))

	before, _, err := p.Expect(ctx, regexp.MustCompile(`login: `))
	require.NoError(t, err)
	assert.Contains(t, before, "Debian GNU/Linux 12 vm-0 ttyS0")
	require.NoError(t, p.SendLine("root"))
	_, _, err = p.Expect(ctx, regexp.MustCompile(`Password: `))
	require.NoError(t, err)
	require.NoError(t, p.SendLine("secret"))
	_, _, err = p.Expect(ctx, regexp.MustCompile(`root@vm-0:~# `))
	require.NoError(t, err)
	require.NoError(t, p.SendLine("echo hello-from-the-guest"))
	_, g, err := p.Expect(ctx, regexp.MustCompile(`\r\n(hello-\S+)\r\n`))
	require.NoError(t, err)
	assert.Equal(t, "hello-from-the-guest", g[1])
	_, _, err = p.Expect(ctx, regexp.MustCompile(`root@vm-0:~# `))
	require.NoError(t, err, "the prompt comes back")

	// pexpect's close: the port forward half-closes and waits for the
	// exporter to end the stream (a serial line has no end of input), which
	// also frees the console for the next session's writer.
	fctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	require.NoError(t, p.Finish(fctx), "the exporter ends the console stream at the client's end of input")
}

// TestPySerialStartConsole: `j console start-console` sends stdin one
// byte per frame and shows the guest's bytes; the third Ctrl-B in a row
// ends it unsent (the first two are sent, as upstream's console does).
func TestPySerialStartConsole(t *testing.T) {
	e, s, uuidOf := leasedSession(t, nil)
	ctx := ctxT(t, 30*time.Second)
	stdin, typist := io.Pipe()
	defer typist.Close()
	stdout := newSyncBuffer()
	done := make(chan error, 1)
	go func() { done <- s.Serial(uuidOf("console")).StartConsole(ctx, stdin, stdout) }()

	guest := nextConsole(ctx, t, e)
	defer guest.Close()
	typed := newSyncBuffer() // what the guest receives
	go func() { _, _ = io.Copy(typed, guest) }()
	_, err := io.WriteString(guest, "vm-0 login: ")
	require.NoError(t, err)
	stdout.waitFor(ctx, t, "vm-0 login: ")

	// Typed as a user types: one byte at a time (each Write returns once
	// start-console has read the byte).
	for _, b := range []byte("root\r\x02\x02x\x02\x02\x02") {
		_, err := typist.Write([]byte{b})
		require.NoError(t, err)
		if b == 'x' {
			_, err = io.WriteString(guest, "\r\nPassword: ")
			require.NoError(t, err)
			stdout.waitFor(ctx, t, "Password: ")
		}
	}
	select {
	case err := <-done:
		require.NoError(t, err, "the third Ctrl-B ends start-console")
	case <-ctx.Done():
		t.Fatal("start-console did not end at the third Ctrl-B")
	}
	typed.waitFor(ctx, t, "root\r\x02\x02x\x02\x02")
	assert.Equal(t, "root\r\x02\x02x\x02\x02", typed.String(), "every byte but the third Ctrl-B reached the guest, in order")
	assert.Equal(t, "vm-0 login: \r\nPassword: ", stdout.String())
}

// TestPySerialPipe: `j console pipe` shows the console until the stream
// ends; PySerial's close ends it ("Serial connection closed normally").
// With piped stdin (`echo CMD | j console pipe`) the command reaches the
// guest, and the end of stdin ends the stream as on upstream's serial
// console (its write_eof fails: a serial port has no end of input).
// --no-output sends stdin and returns.
func TestPySerialPipe(t *testing.T) {
	e, s, uuidOf := leasedSession(t, nil)
	ctx := ctxT(t, 30*time.Second)
	serial := s.Serial(uuidOf("console"))

	// Read-only (stdin a terminal, or --no-input).
	out := newSyncBuffer()
	done := make(chan error, 1)
	go func() { done <- serial.Pipe(ctx, jstest.PipeOptions{Output: out}) }()
	guest := nextConsole(ctx, t, e)
	_, err := io.WriteString(guest, "[  41.000000] kernel message\r\n")
	require.NoError(t, err)
	out.waitFor(ctx, t, "kernel message")
	_, err = io.WriteString(guest, "[  42.000000] later kernel message\r\n")
	require.NoError(t, err)
	out.waitFor(ctx, t, "later kernel message")
	_, err = serial.Call(ctx, "close")
	require.NoError(t, err)
	select {
	case err := <-done:
		assert.NoError(t, err, "close ends the stream normally (EOF)")
	case <-ctx.Done():
		t.Fatal("close did not end pipe's stream")
	}
	assert.Equal(t, "[  41.000000] kernel message\r\n[  42.000000] later kernel message\r\n", out.String())
	guest.Close()

	// Piped stdin.
	input := &eofSignal{r: strings.NewReader("uname -a\n"), eof: make(chan struct{})}
	out = newSyncBuffer()
	go func() { done <- serial.Pipe(ctx, jstest.PipeOptions{Input: input, Output: out}) }()
	guest = nextConsole(ctx, t, e)
	defer guest.Close()
	go func(g net.Conn) { _, _ = io.WriteString(g, "root@vm-0:~# ") }(guest) // the prompt, while stdin goes up
	line, err := bufio.NewReader(guest).ReadString('\n')
	require.NoError(t, err)
	assert.Equal(t, "uname -a\n", line, "stdin reached the guest")
	select {
	case err := <-done:
		assert.NoError(t, err, "the end of stdin ends the stream normally")
	case <-ctx.Done():
		t.Fatal("the end of stdin did not end pipe's stream")
	}
	select {
	case <-input.eof:
	default:
		t.Error("pipe ended before stdin's end")
	}

	// --no-output: fire and forget.
	go func() {
		done <- serial.Pipe(ctx, jstest.PipeOptions{Input: strings.NewReader("reboot\n"), NoOutput: true})
	}()
	guest = nextConsole(ctx, t, e)
	defer guest.Close()
	line, err = bufio.NewReader(guest).ReadString('\n')
	require.NoError(t, err)
	assert.Equal(t, "reboot\n", line)
	require.NoError(t, <-done)
}

// eofSignal closes eof when r is read to its end.
type eofSignal struct {
	r    io.Reader
	eof  chan struct{}
	once sync.Once
}

func (e *eofSignal) Read(p []byte) (int, error) {
	n, err := e.r.Read(p)
	if err == io.EOF {
		e.once.Do(func() { close(e.eof) })
	}
	return n, err
}

// TestPySerialDriverCalls: PySerial's exported calls. set_dtr and set_rts
// take a bool and change nothing (a VM's UART has no modem lines a client
// drives); close ends every open console stream and is a no-op without
// one; a new connect works after it.
func TestPySerialDriverCalls(t *testing.T) {
	e, s, uuidOf := leasedSession(t, nil)
	ctx := ctxT(t, 30*time.Second)
	serial := s.Serial(uuidOf("console"))
	for _, c := range []struct {
		method string
		arg    any
	}{{"set_dtr", true}, {"set_dtr", false}, {"set_rts", true}, {"set_rts", false}} {
		v, err := serial.Call(ctx, c.method, c.arg)
		require.NoError(t, err, "%s(%v)", c.method, c.arg)
		assert.Nil(t, v, "%s returns None", c.method)
	}
	_, err := serial.Call(ctx, "set_dtr", "yes")
	assert.Equal(t, codes.InvalidArgument, status.Code(err), "set_dtr('yes'): %v", err)
	assert.ErrorContains(t, err, "value must be a bool")
	_, err = serial.Call(ctx, "set_rts")
	assert.Equal(t, codes.InvalidArgument, status.Code(err), "set_rts(): %v", err)
	_, err = serial.Call(ctx, "set_baudrate", 9600)
	assert.Equal(t, codes.NotFound, status.Code(err), "not a PySerial export: %v", err)
	_, err = serial.Call(ctx, "close")
	require.NoError(t, err, "close without a stream is a no-op")

	var ps []*jstest.Expecter
	for i := 0; i < 2; i++ {
		p, err := serial.Pexpect(ctx)
		require.NoError(t, err)
		defer p.Close()
		g := nextConsole(ctx, t, e)
		defer g.Close()
		go func() { _, _ = io.Copy(io.Discard, g) }()
		_, err = g.Write([]byte("ready\n"))
		require.NoError(t, err)
		_, _, err = p.Expect(ctx, regexp.MustCompile(`ready`))
		require.NoError(t, err)
		ps = append(ps, p)
	}
	_, err = serial.Call(ctx, "close")
	require.NoError(t, err)
	for i, p := range ps {
		_, _, err := p.Expect(ctx, regexp.MustCompile(`never`))
		require.Error(t, err)
		assert.Contains(t, err.Error(), "the stream ended", "stream %d ends at close", i)
	}
	p, err := serial.Pexpect(ctx)
	require.NoError(t, err, "connect after close")
	defer p.Close()
	go guestShell(nextConsole(ctx, t, e))
	_, _, err = p.Expect(ctx, regexp.MustCompile(`login: `))
	require.NoError(t, err)
}

// TestReportLabelsAndHelp: Register and GetReport carry upstream's
// exporter label jumpstarter.dev/name (the exporter's name) with the
// configured labels; every driver has a description and, keyed by its
// client class's command names, a methods_description (the `j` help).
func TestReportLabelsAndHelp(t *testing.T) {
	e, s, _ := leasedSession(t, func(c *jumpstarter.Config) {
		c.Labels = map[string]string{"jumpstarter.dev/board": "qemu-x86", "jumpstarter.dev/name": "not-the-name", "team": "ci"}
	})
	ctx := ctxT(t, 30*time.Second)
	want := map[string]string{"jumpstarter.dev/board": "qemu-x86", "jumpstarter.dev/name": "vm-0", "team": "ci"}
	rep, err := s.GetReport(ctx)
	require.NoError(t, err)
	assert.Equal(t, want, rep.GetLabels(), "GetReport's labels are Register's (upstream: self.labels)")
	assert.Empty(t, rep.GetMotd(), "no motd, as upstream's default")
	st, ok := e.ctrl.ExporterState(ns, name)
	require.True(t, ok)
	assert.Equal(t, map[string]string{"jumpstarter.dev/board": "qemu-x86", "jumpstarter.dev/name": "vm-0"}, st.Labels,
		"the controller keeps Register's jumpstarter.dev/ labels, the exporter's own name among them")

	type help struct {
		desc    string
		methods map[string]string
	}
	netHelp := func(what string) map[string]string {
		return map[string]string{
			"forward-tcp":  "Forward a local TCP port to " + what,
			"forward-unix": "Forward a local unix socket to " + what,
			"address":      "Not supported: " + what + " is reached through the router only (use forward-tcp)",
		}
	}
	wantHelp := map[string]help{
		"": {desc: "QEMU virtual machine (a qemu-kubelet VM pod)"},
		"power": {desc: "VM power", methods: map[string]string{
			"on":    "Power on: boot the VM from a fresh overlay of its image (the flashed one, if any)",
			"off":   "Power off at once: QEMU is stopped (killed if it has not quit within 5 s), the guest is not shut down; the driver call `shutdown` powers off gracefully (ACPI power button)",
			"cycle": "Power cycle: off at once, wait, on",
			"read":  "Not supported: a VM has no power meter",
		}},
		"flasher": {desc: "Flash and dump the VM's disk and firmware", methods: map[string]string{
			"flash": "Flash FILE, an http(s):// URL or oci://REF onto a partition (--target root, bios, OVMF_CODE.fd or OVMF_VARS.fd); the VM is powered off for the swap and on again if it was on",
			"dump":  "Dump a partition (--target, default root) to FILE: root is the disk as the guest left it (power off first); flashed:PARTITION is what was flashed there, or the pod's image's disk",
		}},
		"console": {desc: "VM serial console (the stream kubectl attach shows)", methods: map[string]string{
			"start-console": "Start the serial console (exit with CTRL+B x 3 times); sessions of the lease type together, as on a pty",
			"pipe":          "Pipe the serial console to stdout or a file; piped stdin goes to the guest, and its end ends the stream (a serial line has no end of input)",
		}},
		"http": {desc: "TCP to guest port 8080", methods: netHelp("guest port 8080")},
		"ssh":  {desc: "TCP to guest port 22", methods: netHelp("guest port 22")},
	}
	got := map[string]help{}
	for _, r := range rep.GetReports() {
		got[r.GetLabels()[jumpstarter.LabelName]] = help{desc: r.GetDescription(), methods: r.GetMethodsDescription()}
	}
	assert.Equal(t, wantHelp, got)
	// The keys are the commands of each client class's cli() (upstream
	// b1f2bb41), which DriverClickGroup.command looks them up by.
	commands := map[string][]string{
		jumpstarter.ClassPower:   {"cycle", "off", "on", "read"},
		jumpstarter.ClassFlasher: {"dump", "flash"},
		jumpstarter.ClassSerial:  {"pipe", "start-console"},
		jumpstarter.ClassNetwork: {"address", "forward-tcp", "forward-unix"},
	}
	for _, r := range rep.GetReports() {
		var keys []string
		for k := range r.GetMethodsDescription() {
			keys = append(keys, k)
		}
		assert.ElementsMatch(t, commands[r.GetLabels()[jumpstarter.LabelClient]], keys, "commands of %s", r.GetLabels()[jumpstarter.LabelName])
	}
}

// shutdownTarget is a fakeTarget with a graceful power off.
type shutdownTarget struct {
	*fakeTarget
	shutdowns int
}

func (s *shutdownTarget) Shutdown(ctx context.Context) error {
	s.mu.Lock()
	s.shutdowns++
	s.mu.Unlock()
	return s.fakeTarget.PowerOff(ctx)
}

// TestPowerOffAndShutdown: PowerClient's off (and cycle: off, wait, on)
// is the target's immediate PowerOff; the graceful path is the power
// driver's shutdown call, Unimplemented on a target without one.
func TestPowerOffAndShutdown(t *testing.T) {
	var st *shutdownTarget
	e, s, uuidOf := leasedSession(t, func(c *jumpstarter.Config) {
		st = &shutdownTarget{fakeTarget: c.Target.(*fakeTarget)}
		c.Target = st
	})
	ctx := ctxT(t, 30*time.Second)
	power := s.Power(uuidOf("power"))
	require.NoError(t, power.On(ctx))
	require.NoError(t, power.Off(ctx))
	ons, offs := e.target.counts()
	assert.Equal(t, [2]int{1, 1}, [2]int{ons, offs})
	assert.Zero(t, st.shutdowns, "off is not the graceful path")
	require.NoError(t, power.Cycle(ctx, 0))
	ons, offs = e.target.counts()
	assert.Equal(t, [2]int{2, 2}, [2]int{ons, offs}, "cycle: off then on")
	assert.True(t, e.target.Powered())

	_, err := s.Call(ctx, uuidOf("power"), "shutdown")
	require.NoError(t, err)
	st.mu.Lock()
	assert.Equal(t, 1, st.shutdowns)
	st.mu.Unlock()
	assert.False(t, e.target.Powered())

	_, s2, uuid2 := leasedSession(t, nil)
	_, err = s2.Call(ctx, uuid2("power"), "shutdown")
	assert.Equal(t, codes.Unimplemented, status.Code(err), "a target without Shutdown: %v", err)
	assert.ErrorContains(t, err, "no graceful power off")
}

// TestPySerialRefusedWriteIsAnError: a console that refuses the client's
// bytes (another party holds it: a `kubectl attach -i` on the pod) ends
// the stream with an error naming why, never with the clean end of
// stream that tells the client its bytes were sent: pexpect's next expect
// and `echo CMD | j console pipe --no-output` both fail with it.
func TestPySerialRefusedWriteIsAnError(t *testing.T) {
	refused := errors.New("the console is held by another party")
	e, s, uuidOf := leasedSession(t, func(c *jumpstarter.Config) {
		c.Target.(*fakeTarget).consoleWriteErr = refused
	})
	ctx := ctxT(t, 30*time.Second)
	serial := s.Serial(uuidOf("console"))

	p, err := serial.Pexpect(ctx)
	require.NoError(t, err)
	defer p.Close()
	guest := nextConsole(ctx, t, e)
	defer guest.Close()
	go func() { _, _ = io.Copy(io.Discard, guest) }()
	_, err = io.WriteString(guest, "vm-0 login: ")
	require.NoError(t, err)
	_, _, err = p.Expect(ctx, regexp.MustCompile(`login: `))
	require.NoError(t, err, "a refused writer still reads")
	require.NoError(t, p.SendLine("root"))
	_, _, err = p.Expect(ctx, regexp.MustCompile(`never`))
	require.Error(t, err)
	assert.Contains(t, err.Error(), "the console refused the client's bytes, which were not sent: "+refused.Error())
	assert.NotContains(t, err.Error(), "EOF", "not the clean end of stream")

	done := make(chan error, 1)
	go func() {
		done <- serial.Pipe(ctx, jstest.PipeOptions{Input: strings.NewReader("reboot\n"), NoOutput: true})
	}()
	g2 := nextConsole(ctx, t, e)
	defer g2.Close()
	select {
	case err := <-done:
		require.Error(t, err, "pipe --no-output fails when its bytes were refused")
		assert.Equal(t, codes.Unknown, status.Code(err), "%v", err)
		assert.Contains(t, err.Error(), refused.Error())
	case <-ctx.Done():
		t.Fatal("pipe --no-output did not end after its bytes were refused")
	}
}
