package jumpstarter_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/jstest"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/pb"
)

// fakeTarget stands in for the VM: the protocol is what is under test here
// (the real VM behind Target is tested by the provider's e2e tests).
type fakeTarget struct {
	mu       sync.Mutex
	powered  bool
	ons      int
	offs     int
	flashed  []string
	guest    map[int]string // guest port -> local TCP address
	consoles chan net.Conn  // the guest side of each Console
	flashErr map[string]error
	// consoleWriteErr, set before the exporter starts, makes every
	// console refuse writes with it (another party holds the console).
	consoleWriteErr error
}

func newFakeTarget() *fakeTarget {
	return &fakeTarget{guest: map[int]string{}, consoles: make(chan net.Conn, 8), flashErr: map[string]error{}}
}

func (f *fakeTarget) PowerOn(context.Context) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.powered = true
	f.ons++
	return nil
}

func (f *fakeTarget) PowerOff(context.Context) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.powered = false
	f.offs++
	return nil
}

func (f *fakeTarget) Powered() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.powered
}

func (f *fakeTarget) counts() (ons, offs int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.ons, f.offs
}

func (f *fakeTarget) Console(context.Context) (io.ReadWriteCloser, error) {
	client, guest := net.Pipe()
	f.consoles <- guest
	if f.consoleWriteErr != nil {
		return refusingConsole{client, f.consoleWriteErr}, nil
	}
	return client, nil
}

// refusingConsole reads the guest's output and refuses every write.
type refusingConsole struct {
	net.Conn
	err error
}

func (r refusingConsole) Write([]byte) (int, error) { return 0, r.err }

func (f *fakeTarget) DialGuest(ctx context.Context, port int) (net.Conn, error) {
	f.mu.Lock()
	addr, ok := f.guest[port]
	f.mu.Unlock()
	if !ok {
		return nil, fmt.Errorf("guest port %d: connection refused", port)
	}
	var d net.Dialer
	return d.DialContext(ctx, "tcp", addr)
}

func (f *fakeTarget) Flash(ctx context.Context, ref string, progress func(string)) error {
	f.mu.Lock()
	err := f.flashErr[ref]
	f.mu.Unlock()
	progress("pulling " + ref)
	if err != nil {
		return err
	}
	progress("verifying " + ref)
	progress("powering off, replacing the disk, powering on")
	f.mu.Lock()
	f.flashed = append(f.flashed, ref)
	f.mu.Unlock()
	return nil
}

// echoServer is a guest TCP service: it echoes lines prefixed "echo: ".
func echoServer(t testing.TB) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				sc := bufio.NewScanner(c)
				for sc.Scan() {
					if _, err := fmt.Fprintf(c, "echo: %s\n", sc.Text()); err != nil {
						return
					}
				}
			}()
		}
	}()
	return l.Addr().String()
}

type stateEvent struct {
	state jumpstarter.State
	err   error
}

// recorder keeps every OnState call and Observer call. wake is poked on
// every state, registration and stream close.
type recorder struct {
	mu            sync.Mutex
	states        []stateEvent
	registrations []error
	registeredAt  []time.Time // when each Register call returned
	calls         []string
	opened        map[string]int
	closed        map[string]int
	wake          chan struct{}
}

func newRecorder() *recorder {
	return &recorder{opened: map[string]int{}, closed: map[string]int{}, wake: make(chan struct{}, 1)}
}

func (r *recorder) poke() {
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

func (r *recorder) onState(s jumpstarter.State, err error) {
	r.mu.Lock()
	r.states = append(r.states, stateEvent{s, err})
	r.mu.Unlock()
	r.poke()
}
func (r *recorder) Registration(err error) {
	r.mu.Lock()
	r.registrations = append(r.registrations, err)
	r.registeredAt = append(r.registeredAt, time.Now())
	r.mu.Unlock()
	r.poke()
}
func (r *recorder) DriverCall(driver, method, code string) {
	r.mu.Lock()
	r.calls = append(r.calls, driver+"."+method+"="+code)
	r.mu.Unlock()
}
func (r *recorder) StreamOpened(kind string) { r.mu.Lock(); r.opened[kind]++; r.mu.Unlock() }
func (r *recorder) StreamClosed(kind string) { r.mu.Lock(); r.closed[kind]++; r.mu.Unlock(); r.poke() }

func (r *recorder) snapshot() []stateEvent {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]stateEvent(nil), r.states...)
}

func (r *recorder) last() stateEvent {
	s := r.snapshot()
	if len(s) == 0 {
		return stateEvent{}
	}
	return s[len(s)-1]
}

// waitState waits until the latest state is s, or s was reported since
// the call (a state the exporter passes through, e.g. Failed before a
// retry's Connecting, counts even if the waiter was not scheduled in time).
func (r *recorder) waitState(t testing.TB, s jumpstarter.State, within time.Duration) stateEvent {
	t.Helper()
	from := len(r.snapshot())
	var got stateEvent
	r.waitFor(t, fmt.Sprintf("state %s", s), within, func() bool {
		all := r.snapshot()
		if len(all) > 0 && all[len(all)-1].state == s {
			got = all[len(all)-1]
			return true
		}
		for _, ev := range all[from:] {
			if ev.state == s {
				got = ev
				return true
			}
		}
		return false
	})
	return got
}

// waitFor waits until cond holds, waking on every recorded event; it
// fails t (showing the states) if that takes longer than within, a bound
// for a hung exporter, not a performance claim.
func (r *recorder) waitFor(t testing.TB, what string, within time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.After(within)
	for {
		if cond() {
			return
		}
		select {
		case <-r.wake:
		case <-time.After(20 * time.Millisecond):
		case <-deadline:
			t.Fatalf("%s not reached within %s; states: %v", what, within, r.snapshot())
		}
	}
}

// logBuf collects every log line of the exporter (to check no token leaks).
type logBuf struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *logBuf) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

type env struct {
	logs   *logBuf
	ctrl   *jstest.Controller
	target *fakeTarget
	rec    *recorder
	cfg    jumpstarter.Config
	cancel context.CancelFunc
	done   chan error
}

const ns, name = "lab", "vm-0"

func startEnv(t testing.TB, insecure bool, mutate func(*jumpstarter.Config)) *env {
	t.Helper()
	ctrl, err := jstest.Start(jstest.Options{Insecure: insecure, DialWait: 10 * time.Second})
	require.NoError(t, err)
	t.Cleanup(ctrl.Close)
	token := ctrl.AddExporter(ns, name, "")
	tgt := newFakeTarget()
	tgt.guest[8080] = echoServer(t)
	rec := newRecorder()
	logs := &logBuf{}
	cfg := jumpstarter.Config{
		Log: funcr.New(func(prefix, args string) {
			logs.mu.Lock()
			fmt.Fprintln(&logs.b, prefix, args)
			logs.mu.Unlock()
		}, funcr.Options{Verbosity: 10}),
		Endpoint: ctrl.Endpoint(), Token: token, Namespace: ns, Name: name,
		CABundle: ctrl.CABundle(), Insecure: insecure,
		Labels:   map[string]string{"jumpstarter.dev/board": "qemu-x86", "team": "ci"},
		Target:   tgt,
		Ports:    []jumpstarter.Port{{Name: "http", Port: 8080}, {Name: "ssh", Port: 22}},
		Hostname: "vm-0.lab", Username: "root", Password: "secret",
		OnState: rec.onState, Observer: rec,
		BackoffInitial: 100 * time.Millisecond, BackoffMax: 400 * time.Millisecond,
	}
	if mutate != nil {
		mutate(&cfg)
	}
	e, err := jumpstarter.New(cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Run(ctx) }()
	ev := &env{logs: logs, ctrl: ctrl, target: tgt, rec: rec, cfg: cfg, cancel: cancel, done: done}
	t.Cleanup(func() { ev.stop(t) })
	return ev
}

func (e *env) stop(t testing.TB) {
	e.cancel()
	select {
	case err := <-e.done:
		assert.NoError(t, err)
		e.done <- nil // stop is idempotent
	case <-time.After(10 * time.Second):
		t.Errorf("Run did not return within 10s of cancel")
	}
}

func ctxT(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func online(s jstest.ExporterState) bool {
	return s.Registered && s.Online && s.Status == pb.ExporterStatus_EXPORTER_STATUS_AVAILABLE
}

func leaseReady(s jstest.ExporterState) bool {
	return s.Online && s.Status == pb.ExporterStatus_EXPORTER_STATUS_LEASE_READY
}

// TestExporterLeaseSession walks one lease through the router over TLS:
// every driver, the errors, a parked connection and the lease's end.
func TestExporterLeaseSession(t *testing.T) {
	e := startEnv(t, false, nil)
	ctx := ctxT(t, 60*time.Second)

	st, err := e.ctrl.WaitExporter(ctx, ns, name, online)
	require.NoError(t, err)
	e.rec.waitState(t, jumpstarter.StateOnline, 5*time.Second)
	assert.Equal(t, map[string]string{"jumpstarter.dev/board": "qemu-x86", "jumpstarter.dev/name": "vm-0"}, st.Labels,
		"the controller keeps only jumpstarter.dev/ labels; jumpstarter.dev/name is the exporter's name, as upstream's exporter sends it")
	require.Len(t, st.Reports, 6, "root, power, flasher, console, http, ssh registered")
	var seq []jumpstarter.State
	for _, s := range e.rec.snapshot() {
		seq = append(seq, s.state)
	}
	assert.Equal(t, []jumpstarter.State{jumpstarter.StateConnecting, jumpstarter.StateRegistered, jumpstarter.StateOnline}, seq)

	require.NoError(t, e.ctrl.AssignLease(ns, "lease-1", name, "alice"))
	_, err = e.ctrl.WaitExporter(ctx, ns, name, leaseReady)
	require.NoError(t, err)
	e.rec.waitState(t, jumpstarter.StateLeased, 5*time.Second)

	cl := e.ctrl.NewClient(ns, "alice")

	// jmp makes one connection it never uses: it must not block the next.
	parked, err := cl.DialToken(ctx, "lease-1")
	require.NoError(t, err)
	require.NotEmpty(t, parked.GetRouterToken())

	s, err := cl.Dial(ctx, "lease-1")
	require.NoError(t, err)
	defer s.Close()

	rep, err := s.GetReport(ctx)
	require.NoError(t, err)
	checkReport(t, rep)
	uuidOf := func(n string) string {
		d, ok := jstest.FindDriver(rep, n)
		require.True(t, ok, "driver %q", n)
		return d.GetUuid()
	}

	gs, err := s.GetStatus(ctx)
	require.NoError(t, err)
	assert.Equal(t, pb.ExporterStatus_EXPORTER_STATUS_LEASE_READY, gs.GetStatus())

	// Root calls (QemuClient.hostname/username/password).
	for m, want := range map[string]string{"get_hostname": "vm-0.lab", "get_username": "root", "get_password": "secret"} {
		v, err := s.Call(ctx, uuidOf(""), m)
		require.NoError(t, err, m)
		assert.Equal(t, want, v, m)
	}

	// Power: on and off reach the target; rescue and read are refused clearly.
	_, err = s.Call(ctx, uuidOf("power"), "on")
	require.NoError(t, err)
	assert.True(t, e.target.Powered())
	_, err = s.Call(ctx, uuidOf("power"), "off")
	require.NoError(t, err)
	assert.False(t, e.target.Powered())
	ons, offs := e.target.counts()
	assert.Equal(t, 1, ons)
	assert.Equal(t, 1, offs)
	_, err = s.Call(ctx, uuidOf("power"), "rescue")
	assert.Equal(t, codes.Unimplemented, status.Code(err), "rescue: %v", err)
	err = s.StreamingCall(ctx, uuidOf("power"), "read", nil, func(any) error { return nil })
	assert.Equal(t, codes.Unimplemented, status.Code(err), "read: %v", err)

	// Console: bytes both ways.
	con, err := s.Stream(ctx, uuidOf("console"), "connect")
	require.NoError(t, err)
	var guest net.Conn
	select {
	case guest = <-e.target.consoles:
	case <-ctx.Done():
		t.Fatal("the console was not opened on the target")
	}
	_, err = con.Write([]byte("root\n"))
	require.NoError(t, err)
	buf := make([]byte, 5)
	_, err = io.ReadFull(guest, buf)
	require.NoError(t, err)
	assert.Equal(t, "root\n", string(buf))
	_, err = guest.Write([]byte("Password: "))
	require.NoError(t, err)
	buf = make([]byte, 10)
	_, err = io.ReadFull(con, buf)
	require.NoError(t, err)
	assert.Equal(t, "Password: ", string(buf))
	// The guest side ends: the client reads EOF (GOAWAY).
	guest.Close()
	_, err = con.Read(buf)
	assert.ErrorIs(t, err, io.EOF)
	con.Close()

	// TCP to a guest port.
	tcp, err := s.Stream(ctx, uuidOf("http"), "connect")
	require.NoError(t, err)
	_, err = tcp.Write([]byte("GET /\n"))
	require.NoError(t, err)
	line, err := bufio.NewReader(tcp).ReadString('\n')
	require.NoError(t, err)
	assert.Equal(t, "echo: GET /\n", line)
	tcp.Close()
	// A port nothing listens on fails the stream with the target's error.
	_, err = s.Stream(ctx, uuidOf("ssh"), "connect")
	require.Error(t, err)
	assert.Contains(t, err.Error(), "connection refused")

	// flash_oci streams (stdout, stderr, returncode) tuples, the last one
	// ("", "", 0); the target gets the reference without oci://.
	var tuples [][]any
	err = s.StreamingCall(ctx, uuidOf("flasher"), "flash_oci", []any{"oci://registry.local/os:v2", nil}, func(v any) error {
		tup, ok := v.([]any)
		if !ok || len(tup) != 3 {
			return fmt.Errorf("result %#v is not a 3-tuple", v)
		}
		tuples = append(tuples, tup)
		return nil
	})
	require.NoError(t, err)
	require.Len(t, tuples, 4)
	assert.Equal(t, []any{"pulling registry.local/os:v2\n", "", nil}, tuples[0])
	assert.Equal(t, []any{"", "", float64(0)}, tuples[3])
	assert.Equal(t, []string{"registry.local/os:v2"}, e.target.flashed)
	// flash(source) with oci:// does the same; without it is refused.
	_, err = s.Call(ctx, uuidOf("flasher"), "flash", "oci://registry.local/os:v3", nil)
	require.NoError(t, err)
	_, err = s.Call(ctx, uuidOf("flasher"), "flash", "/tmp/disk.img", nil)
	assert.Equal(t, codes.InvalidArgument, status.Code(err), "flash of a path: %v", err)
	err = s.StreamingCall(ctx, uuidOf("flasher"), "flash_oci", []any{"registry.local/os:v2"}, func(any) error { return nil })
	assert.Equal(t, codes.InvalidArgument, status.Code(err), "flash_oci without oci://: %v", err)
	e.target.flashErr["registry.local/bad:1"] = errors.New("manifest unknown")
	err = s.StreamingCall(ctx, uuidOf("flasher"), "flash_oci", []any{"oci://registry.local/bad:1"}, func(any) error { return nil })
	require.Error(t, err)
	assert.Contains(t, err.Error(), "manifest unknown")

	// Unknown driver or method: an error, and the exporter keeps serving.
	_, err = s.Call(ctx, "00000000-0000-4000-8000-000000000000", "on")
	assert.Equal(t, codes.NotFound, status.Code(err), "unknown uuid: %v", err)
	_, err = s.Call(ctx, "not-a-uuid", "on")
	assert.Equal(t, codes.InvalidArgument, status.Code(err), "bad uuid: %v", err)
	_, err = s.Call(ctx, uuidOf("power"), "explode")
	assert.Equal(t, codes.NotFound, status.Code(err), "unknown method: %v", err)
	_, err = s.Stream(ctx, uuidOf("power"), "connect")
	assert.Equal(t, codes.NotFound, status.Code(err), "stream to power: %v", err)
	// Upper-case UUIDs are accepted (clients send str(UUID)).
	v, err := s.Call(ctx, strings.ToUpper(uuidOf("")), "get_hostname")
	require.NoError(t, err)
	assert.Equal(t, "vm-0.lab", v)

	// A second connection on the same lease works while the first is open
	// and the parked one still waits.
	s2, err := cl.Dial(ctx, "lease-1")
	require.NoError(t, err)
	_, err = s2.GetReport(ctx)
	require.NoError(t, err)
	s2.Close()
	// The exporter's side of the parked connection reaches the router on a
	// goroutine of its own: wait for it, then it stays until the lease ends.
	require.NoError(t, e.ctrl.WaitFor(ctx, func() bool { return e.ctrl.PendingStreams() >= 1 }), "the parked connection's stream waits at the router")

	// The server side of a stream the client closed ends on its own
	// goroutine, after the client's Close returned: wait for it.
	e.rec.waitFor(t, "every byte stream closed", 10*time.Second, func() bool {
		e.rec.mu.Lock()
		defer e.rec.mu.Unlock()
		return maps.Equal(e.rec.closed, e.rec.opened)
	})
	e.rec.mu.Lock()
	assert.Contains(t, e.rec.calls, "power.on=OK")
	assert.Contains(t, e.rec.calls, "power.explode=NotFound")
	assert.Equal(t, map[string]int{"console": 1, "tcp": 1}, e.rec.opened, "byte streams opened")
	assert.Equal(t, e.rec.opened, e.rec.closed, "every byte stream closed")
	e.rec.mu.Unlock()

	// The lease ends: AVAILABLE again, every connection closed (the parked
	// one too), Online state.
	require.NoError(t, e.ctrl.EndLease(ns, "lease-1"))
	_, err = e.ctrl.WaitExporter(ctx, ns, name, online)
	require.NoError(t, err)
	e.rec.waitState(t, jumpstarter.StateOnline, 5*time.Second)
	require.NoError(t, e.ctrl.WaitFor(ctx, func() bool { return e.ctrl.PendingStreams() == 0 }), "the parked stream is closed at lease end")
	_, err = s.GetReport(ctx)
	assert.Error(t, err, "the lease's connection is closed")

	// A new lease lands on the same exporter; EndSession reports AVAILABLE.
	require.NoError(t, e.ctrl.AssignLease(ns, "lease-2", name, "alice"))
	s3, err := cl.Dial(ctx, "lease-2")
	require.NoError(t, err)
	defer s3.Close()
	es, err := s3.Exporter.EndSession(ctx, &pb.EndSessionRequest{})
	require.NoError(t, err)
	assert.True(t, es.GetSuccess())
	gs, err = s3.GetStatus(ctx)
	require.NoError(t, err)
	assert.Equal(t, pb.ExporterStatus_EXPORTER_STATUS_AVAILABLE, gs.GetStatus())
	assert.Equal(t, pb.ExporterStatus_EXPORTER_STATUS_LEASE_READY, gs.GetPreviousStatus())
	_, err = e.ctrl.WaitExporter(ctx, ns, name, func(s jstest.ExporterState) bool {
		return s.Status == pb.ExporterStatus_EXPORTER_STATUS_AVAILABLE && s.Lease == "lease-2"
	})
	require.NoError(t, err)

	// Stop: Unregister, Stopped.
	e.stop(t)
	st, _ = e.ctrl.ExporterState(ns, name)
	assert.True(t, st.Unregistered, "Unregister on stop")
	assert.Equal(t, jumpstarter.StateStopped, e.rec.last().state)
	assert.Contains(t, e.logs.String(), "lease assigned", "the exporter logs")
	assert.NotContains(t, e.logs.String(), e.cfg.Token, "the token is never logged")
	assert.NotContains(t, e.logs.String(), parked.GetRouterToken(), "router tokens are never logged")
}

// checkReport asserts what the Python client needs to build its tree.
func checkReport(t *testing.T, rep *pb.GetReportResponse) {
	t.Helper()
	want := map[string]string{
		"":        jumpstarter.ClassQemu,
		"power":   jumpstarter.ClassPower,
		"flasher": jumpstarter.ClassFlasher,
		"console": jumpstarter.ClassSerial,
		"http":    jumpstarter.ClassNetwork,
		"ssh":     jumpstarter.ClassNetwork,
	}
	assert.Equal(t, "jumpstarter_driver_qemu.client.QemuClient", jumpstarter.ClassQemu)
	assert.Equal(t, "jumpstarter_driver_power.client.PowerClient", jumpstarter.ClassPower)
	assert.Equal(t, "jumpstarter_driver_qemu.client.QemuFlasherClient", jumpstarter.ClassFlasher)
	assert.Equal(t, "jumpstarter_driver_network.client.NetworkClient", jumpstarter.ClassNetwork)
	assert.Equal(t, "jumpstarter_driver_pyserial.client.PySerialClient", jumpstarter.ClassSerial)
	assert.Equal(t, "qemu-x86", rep.GetLabels()["jumpstarter.dev/board"])
	assert.Equal(t, strings.ToLower(rep.GetUuid()), rep.GetUuid())
	seen := map[string]bool{}
	roots := 0
	got := map[string]string{}
	for _, r := range rep.GetReports() {
		assert.Equal(t, strings.ToLower(r.GetUuid()), r.GetUuid(), "lowercase uuid")
		assert.Len(t, r.GetUuid(), 36)
		assert.NotEmpty(t, r.GetLabels()[jumpstarter.LabelClient], "client label on %s", r.GetUuid())
		if r.ParentUuid == nil {
			roots++
			got[""] = r.GetLabels()[jumpstarter.LabelClient]
		} else {
			assert.True(t, seen[r.GetParentUuid()], "parent of %s listed before it", r.GetUuid())
			n := r.GetLabels()[jumpstarter.LabelName]
			assert.NotEmpty(t, n, "name label on child %s", r.GetUuid())
			got[n] = r.GetLabels()[jumpstarter.LabelClient]
		}
		seen[r.GetUuid()] = true
	}
	assert.Equal(t, 1, roots, "exactly one root")
	assert.Equal(t, want, got)
}

// TestExporterWrongToken: an Unauthenticated token is reported as Failed
// with a clear error, retried with backoff (no hot loop), never logged.
func TestExporterWrongToken(t *testing.T) {
	e := startEnv(t, true, func(c *jumpstarter.Config) { c.Token = "not-the-token" })
	ev := e.rec.waitState(t, jumpstarter.StateFailed, 5*time.Second)
	require.Error(t, ev.err)
	assert.Contains(t, ev.err.Error(), "the controller rejected the exporter token")
	assert.Contains(t, ev.err.Error(), "failed to authenticate token", "the controller's own words")
	assert.NotContains(t, ev.err.Error(), "not-the-token")
	assert.Contains(t, e.logs.String(), "rejected the exporter token")
	assert.NotContains(t, e.logs.String(), "not-the-token", "the token is never logged")
	// Retried with backoff 100, 200, 400, 400 ms (BackoffInitial doubling
	// to BackoffMax): each attempt starts at least that long after the last
	// one failed, however slow the machine (a hot loop would not wait).
	e.rec.waitFor(t, "5 registration attempts", 30*time.Second, func() bool {
		e.rec.mu.Lock()
		defer e.rec.mu.Unlock()
		return len(e.rec.registeredAt) >= 5
	})
	e.rec.mu.Lock()
	at := append([]time.Time(nil), e.rec.registeredAt...)
	for _, err := range e.rec.registrations {
		assert.Error(t, err, "a registration with a wrong token")
	}
	e.rec.mu.Unlock()
	for i, want := range []time.Duration{100, 200, 400, 400} {
		assert.GreaterOrEqual(t, at[i+1].Sub(at[i]), want*time.Millisecond, "attempt %d waits its backoff", i+2)
	}
	st, _ := e.ctrl.ExporterState(ns, name)
	assert.False(t, st.Registered)
	assert.False(t, st.Online)
}

// TestExporterControllerRestart: the controller (and router) restart
// mid-session: the exporter re-registers and is Online again, and a lease
// assigned before the restart is served after it.
func TestExporterControllerRestart(t *testing.T) {
	e := startEnv(t, true, nil)
	ctx := ctxT(t, 60*time.Second)
	_, err := e.ctrl.WaitExporter(ctx, ns, name, online)
	require.NoError(t, err)
	require.NoError(t, e.ctrl.AssignLease(ns, "lease-1", name, "bob"))
	_, err = e.ctrl.WaitExporter(ctx, ns, name, leaseReady)
	require.NoError(t, err)

	e.ctrl.Stop()
	e.rec.waitState(t, jumpstarter.StateFailed, 5*time.Second)
	require.NoError(t, e.ctrl.Start())
	st, err := e.ctrl.WaitExporter(ctx, ns, name, func(s jstest.ExporterState) bool {
		return s.Registrations >= 2 && leaseReady(s)
	})
	require.NoError(t, err)
	assert.Equal(t, 2, st.Registrations)

	cl := e.ctrl.NewClient(ns, "bob")
	s, err := cl.Dial(ctx, "lease-1")
	require.NoError(t, err)
	defer s.Close()
	rep, err := s.GetReport(ctx)
	require.NoError(t, err)
	d, _ := jstest.FindDriver(rep, "power")
	_, err = s.Call(ctx, d.GetUuid(), "on")
	require.NoError(t, err)
	assert.True(t, e.target.Powered())

	require.NoError(t, e.ctrl.EndLease(ns, "lease-1"))
	_, err = e.ctrl.WaitExporter(ctx, ns, name, online)
	require.NoError(t, err)
}

// TestExporterAuthErrors: what the pod's owner reads (OnState's error) for
// each way the real controller refuses an exporter.
func TestExporterAuthErrors(t *testing.T) {
	for _, c := range []struct {
		name   string
		mutate func(*jumpstarter.Config, *jstest.Controller)
		want   string
	}{
		{"no such Exporter", func(cfg *jumpstarter.Config, _ *jstest.Controller) { cfg.Name = "vm-9" },
			"the controller has no Exporter object lab/vm-9"},
		{"another exporter's token", func(cfg *jumpstarter.Config, ctrl *jstest.Controller) {
			cfg.Token = ctrl.AddExporter(ns, "vm-1", "")
		}, "the token is not exporter lab/vm-0's"},
		{"a client's token", func(cfg *jumpstarter.Config, ctrl *jstest.Controller) {
			cfg.Token = ctrl.AddClient(ns, "alice", "")
		}, "the token is not exporter lab/vm-0's"},
	} {
		t.Run(c.name, func(t *testing.T) {
			ctrl, err := jstest.Start(jstest.Options{Insecure: true})
			require.NoError(t, err)
			defer ctrl.Close()
			cfgTok := ctrl.AddExporter(ns, name, "")
			e := startEnv(t, true, func(cfg *jumpstarter.Config) {
				cfg.Endpoint, cfg.Token = ctrl.Endpoint(), cfgTok
				c.mutate(cfg, ctrl)
			})
			ev := e.rec.waitState(t, jumpstarter.StateFailed, 5*time.Second)
			require.Error(t, ev.err)
			assert.Contains(t, ev.err.Error(), c.want)
		})
	}
	// The controller's authenticator not ready yet: temporary, retried soon.
	ctrl, err := jstest.Start(jstest.Options{Insecure: true, AuthDelay: 1500 * time.Millisecond})
	require.NoError(t, err)
	defer ctrl.Close()
	tok := ctrl.AddExporter(ns, name, "")
	e := startEnv(t, true, func(cfg *jumpstarter.Config) {
		cfg.Endpoint, cfg.Token = ctrl.Endpoint(), tok
		cfg.BackoffInitial, cfg.BackoffMax = 2*time.Second, time.Minute
	})
	ev := e.rec.waitState(t, jumpstarter.StateFailed, 5*time.Second)
	assert.Contains(t, ev.err.Error(), "the controller is still starting")
	// Temporary: retried at most 2 s apart whatever the backoff (the delay
	// itself is retryDelay's, TestClassifyAndRetryDelay), so the exporter
	// is online once the authenticator is.
	assert.Equal(t, "temporary", jumpstarter.FailureReason(ev.err))
	_, err = ctrl.WaitExporter(ctxT(t, 30*time.Second), ns, name, online)
	require.NoError(t, err)
}

// TestExporterLeaseSurvivesControllerRestart: only the controller restarts
// (upstream's router is another process and stays up): a byte stream the
// client opened before keeps working, and the exporter comes back Online
// with the same lease, ready for new connections.
func TestExporterLeaseSurvivesControllerRestart(t *testing.T) {
	e := startEnv(t, true, nil)
	ctx := ctxT(t, 60*time.Second)
	_, err := e.ctrl.WaitExporter(ctx, ns, name, online)
	require.NoError(t, err)
	require.NoError(t, e.ctrl.AssignLease(ns, "lease-1", name, "bob"))
	_, err = e.ctrl.WaitExporter(ctx, ns, name, leaseReady)
	require.NoError(t, err)

	cl := e.ctrl.NewClient(ns, "bob")
	s, err := cl.Dial(ctx, "lease-1")
	require.NoError(t, err)
	defer s.Close()
	rep, err := s.GetReport(ctx)
	require.NoError(t, err)
	con, _ := jstest.FindDriver(rep, "console")
	stream, err := s.Stream(ctx, con.GetUuid(), "connect")
	require.NoError(t, err)
	defer stream.Close()
	var guest net.Conn
	select {
	case guest = <-e.target.consoles:
	case <-ctx.Done():
		t.Fatal("the console was not opened on the target")
	}
	roundTrip := func(what string) {
		t.Helper()
		go func() { _, _ = stream.Write([]byte(what)) }()
		buf := make([]byte, len(what))
		_, err := io.ReadFull(guest, buf)
		require.NoError(t, err, what)
		assert.Equal(t, what, string(buf))
		go func() { _, _ = guest.Write([]byte("<" + what)) }()
		back := make([]byte, len(what)+1)
		_, err = io.ReadFull(stream, back)
		require.NoError(t, err, what)
		assert.Equal(t, "<"+what, string(back))
	}
	roundTrip("before")

	regs := 0
	if st, ok := e.ctrl.ExporterState(ns, name); ok {
		regs = st.Registrations
	}
	e.ctrl.StopController()
	e.rec.waitState(t, jumpstarter.StateFailed, 5*time.Second)
	roundTrip("during") // the router alone carries it
	require.NoError(t, e.ctrl.StartController())
	st, err := e.ctrl.WaitExporter(ctx, ns, name, func(s jstest.ExporterState) bool {
		return s.Registrations > regs && leaseReady(s)
	})
	require.NoError(t, err)
	assert.Equal(t, "lease-1", st.Lease)
	e.rec.waitState(t, jumpstarter.StateLeased, 5*time.Second)
	roundTrip("after")

	// A new connection on the same lease, through the new controller.
	s2, err := cl.Dial(ctx, "lease-1")
	require.NoError(t, err)
	defer s2.Close()
	gs, err := s2.GetStatus(ctx)
	require.NoError(t, err)
	assert.Equal(t, pb.ExporterStatus_EXPORTER_STATUS_LEASE_READY, gs.GetStatus())
	roundTrip("still")

	// The lease's end still closes the old stream.
	require.NoError(t, e.ctrl.EndLease(ns, "lease-1"))
	_, err = e.ctrl.WaitExporter(ctx, ns, name, online)
	require.NoError(t, err)
	ended := make(chan struct{})
	go func() { _, _ = io.ReadAll(stream); close(ended) }()
	select {
	case <-ended:
	case <-time.After(10 * time.Second):
		t.Fatal("the console stream outlived its lease")
	}
}

func TestNewRejectsBadConfig(t *testing.T) {
	tgt := newFakeTarget()
	base := jumpstarter.Config{Endpoint: "127.0.0.1:1", Token: "t", Namespace: "n", Name: "x", Target: tgt}
	for name, mut := range map[string]func(*jumpstarter.Config){
		"no endpoint":     func(c *jumpstarter.Config) { c.Endpoint = "" },
		"no target":       func(c *jumpstarter.Config) { c.Target = nil },
		"port name taken": func(c *jumpstarter.Config) { c.Ports = []jumpstarter.Port{{Name: "console", Port: 22}} },
		"port range":      func(c *jumpstarter.Config) { c.Ports = []jumpstarter.Port{{Name: "ssh", Port: 0}} },
		"duplicate port": func(c *jumpstarter.Config) {
			c.Ports = []jumpstarter.Port{{Name: "ssh", Port: 22}, {Name: "ssh", Port: 2222}}
		},
		"bad CA": func(c *jumpstarter.Config) { c.CABundle = []byte("not pem") },
	} {
		c := base
		mut(&c)
		_, err := jumpstarter.New(c)
		assert.Error(t, err, name)
	}
	_, err := jumpstarter.New(base)
	assert.NoError(t, err)
}

// TestExporterConcurrentConnections: many jmp/j commands at once, each its
// own Dial and connection, plus parked ones: none waits for another.
func TestExporterConcurrentConnections(t *testing.T) {
	e := startEnv(t, true, nil)
	ctx := ctxT(t, 60*time.Second)
	_, err := e.ctrl.WaitExporter(ctx, ns, name, online)
	require.NoError(t, err)
	require.NoError(t, e.ctrl.AssignLease(ns, "l", name, "c"))
	cl := e.ctrl.NewClient(ns, "c")
	for i := 0; i < 3; i++ {
		_, err := cl.DialToken(ctx, "l") // parked
		require.NoError(t, err)
	}
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for i := 0; i < 8; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s, err := cl.Dial(ctx, "l")
			if err != nil {
				errs <- err
				return
			}
			defer s.Close()
			rep, err := s.GetReport(ctx)
			if err != nil {
				errs <- err
				return
			}
			root, _ := jstest.FindDriver(rep, "")
			v, err := s.Call(ctx, root.GetUuid(), "get_hostname")
			if err == nil && v != "vm-0.lab" {
				err = fmt.Errorf("get_hostname = %v", v)
			}
			if err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	// Each parked token's stream reaches the router on its own goroutine,
	// in no order with the 8 served ones: wait for the three.
	require.NoError(t, e.ctrl.WaitFor(ctx, func() bool { return e.ctrl.PendingStreams() == 3 }), "the parked connections still wait (pending %d)", e.ctrl.PendingStreams())
	require.NoError(t, e.ctrl.EndLease(ns, "l"))
	require.NoError(t, e.ctrl.WaitFor(ctx, func() bool { return e.ctrl.PendingStreams() == 0 }), "closed at lease end")
}
