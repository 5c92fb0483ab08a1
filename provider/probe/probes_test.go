package probe

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/qemu-kubelet/qemu-kubelet/provider/guest"
)

func TestProbeCounter(t *testing.T) {
	for _, tc := range []struct {
		name     string
		probe    corev1.Probe
		initial  bool
		outcomes []bool
		want     []bool
	}{
		{"readiness: one success", corev1.Probe{SuccessThreshold: 1, FailureThreshold: 3}, false,
			[]bool{false, true, false, false, false, true}, []bool{false, true, true, true, false, true}},
		{"two successes needed", corev1.Probe{SuccessThreshold: 2, FailureThreshold: 1}, false,
			[]bool{true, false, true, true, false}, []bool{false, false, false, true, false}},
		{"liveness: initially alive, defaults", corev1.Probe{}, true,
			[]bool{false, false, true, false, false, false}, []bool{true, true, true, true, true, false}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newProbeCounter(&tc.probe, tc.initial)
			var got []bool
			for _, o := range tc.outcomes {
				got = append(got, c.observe(o))
			}
			assert.Equal(t, tc.want, got)
		})
	}
}

func TestApplyProbes(t *testing.T) {
	started := metav1.NewTime(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	status := func() *corev1.PodStatus {
		return &corev1.PodStatus{
			ContainerStatuses: []corev1.ContainerStatus{{Name: "vm", Ready: true, State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: started}}}},
			Conditions: []corev1.PodCondition{
				{Type: corev1.PodInitialized, Status: corev1.ConditionTrue},
				{Type: corev1.ContainersReady, Status: corev1.ConditionTrue},
				{Type: corev1.PodReady, Status: corev1.ConditionTrue},
			},
		}
	}
	plain := &corev1.Pod{Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "vm"}}}}
	probed := plain.DeepCopy()
	probed.Spec.Containers[0].ReadinessProbe = &corev1.Probe{}

	s := status()
	Apply(s, plain, nil)
	assert.True(t, s.ContainerStatuses[0].Ready, "no readiness probe: as PodStatus says")

	notReady := func(s *corev1.PodStatus) {
		t.Helper()
		assert.False(t, s.ContainerStatuses[0].Ready)
		assert.Equal(t, corev1.ConditionTrue, s.Conditions[0].Status)
		for _, c := range s.Conditions[1:] {
			assert.Equal(t, corev1.ConditionFalse, c.Status)
			assert.Equal(t, "ContainersNotReady", c.Reason)
			assert.Equal(t, "containers with unready status: [vm]", c.Message)
		}
	}
	// A readiness probe whose run has not reported yet: not ready.
	s = status()
	Apply(s, probed, nil)
	notReady(s)

	ps := &State{run: started.Time}
	s = status()
	Apply(s, probed, ps)
	notReady(s)
	assert.True(t, ps.set(true, ""))
	assert.False(t, ps.set(true, ""), "no change")
	s = status()
	Apply(s, probed, ps)
	assert.True(t, s.ContainerStatuses[0].Ready)
	assert.Equal(t, corev1.ConditionTrue, s.Conditions[2].Status)

	// The previous run's result does not make a new run ready.
	s = status()
	s.ContainerStatuses[0].State.Running.StartedAt = metav1.NewTime(started.Add(time.Minute))
	Apply(s, probed, ps)
	notReady(s)

	// A startup probe holds Started and Ready until it succeeded.
	startup := probed.DeepCopy()
	startup.Spec.Containers[0].StartupProbe = &corev1.Probe{}
	st := &State{run: started.Time, ready: true}
	s = status()
	Apply(s, startup, st)
	notReady(s)
	require.NotNil(t, s.ContainerStatuses[0].Started)
	assert.False(t, *s.ContainerStatuses[0].Started)
	st.setStarted()
	s = status()
	Apply(s, startup, st)
	assert.True(t, s.ContainerStatuses[0].Ready)
	assert.True(t, *s.ContainerStatuses[0].Started)
	// Startup probe only: ready once started.
	onlyStartup := plain.DeepCopy()
	onlyStartup.Spec.Containers[0].StartupProbe = &corev1.Probe{}
	s = status()
	Apply(s, onlyStartup, &State{run: started.Time})
	notReady(s)
	s = status()
	Apply(s, onlyStartup, st)
	assert.True(t, s.ContainerStatuses[0].Ready)

	// Not running: untouched.
	s = status()
	s.ContainerStatuses[0].State = corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{}}
	s.ContainerStatuses[0].Ready = false
	Apply(s, probed, ps)
	assert.False(t, s.ContainerStatuses[0].Ready)
}

func TestStaleProbeForwards(t *testing.T) {
	ledger := []byte("100 4001\n100 4002\n200 5001\ngarbage\n100 x\n")
	assert.Equal(t, []int{4001, 4002}, staleProbeForwards(ledger, 100))
	assert.Equal(t, []int{5001}, staleProbeForwards(ledger, 200))
	assert.Empty(t, staleProbeForwards(ledger, 300))
}

func TestProbePortAndDurations(t *testing.T) {
	c := &corev1.Container{Ports: []corev1.ContainerPort{{Name: "http", ContainerPort: 8080}}}
	p, err := probePort(intstr.FromString("http"), c)
	require.NoError(t, err)
	assert.Equal(t, 8080, p)
	p, err = probePort(intstr.FromInt32(22), c)
	require.NoError(t, err)
	assert.Equal(t, 22, p)
	_, err = probePort(intstr.FromString("ssh"), c)
	assert.ErrorContains(t, err, `port "ssh" not found`)
	_, err = probePort(intstr.FromInt32(0), c)
	assert.Error(t, err)

	d, per, to := probeDurations(&corev1.Probe{InitialDelaySeconds: 2, PeriodSeconds: 3, TimeoutSeconds: 4})
	assert.Equal(t, []time.Duration{2 * time.Second, 3 * time.Second, 4 * time.Second}, []time.Duration{d, per, to})
	d, per, to = probeDurations(&corev1.Probe{})
	assert.Equal(t, []time.Duration{0, 10 * time.Second, time.Second}, []time.Duration{d, per, to})
}

// TestProbeChecks runs the tcp and http checks against local servers that
// behave like QEMU's forward: accept, then keep open (guest listening) or
// close at once (guest refused); QEMU's connection table is faked.
func TestProbeChecks(t *testing.T) {
	open := listenTCP(t, false)
	refused := listenTCP(t, true)
	// What QEMU would report: the open port's connection established.
	usernet := func(context.Context) (string, error) {
		return fmt.Sprintf("  TCP[ESTABLISHED] 13 127.0.0.1 %d 10.0.2.15 80 0 0\n  TCP[HOST_FORWARD] 9 127.0.0.1 %d 10.0.2.15 81 0 0\n", open, refused), nil
	}
	ok, msg := tcpCheck(context.Background(), usernet, open, 80, 300*time.Millisecond)
	assert.True(t, ok, msg)
	ok, msg = tcpCheck(context.Background(), usernet, refused, 81, 2*time.Second)
	assert.False(t, ok)
	assert.Contains(t, msg, "guest port 81")
	assert.Contains(t, msg, "refused by the guest")
	// Never established: no answer within the timeout.
	ok, msg = tcpCheck(context.Background(), func(context.Context) (string, error) { return "", nil }, open, 80, 300*time.Millisecond)
	assert.False(t, ok)
	assert.Contains(t, msg, "did not answer")

	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/healthz":
			if r.Header.Get("X-Probe") != "yes" || r.Host != "guest.example" {
				w.WriteHeader(http.StatusBadRequest)
			}
		case "/redirect":
			http.Redirect(w, r, "/elsewhere", http.StatusFound)
		default:
			w.WriteHeader(http.StatusServiceUnavailable)
		}
	}))
	defer srv.Close()
	u, _ := url.Parse(srv.URL)
	port, _ := strconv.Atoi(u.Port())
	hg := func(path string) *corev1.HTTPGetAction {
		return &corev1.HTTPGetAction{Path: path, Port: intstr.FromInt32(8080),
			HTTPHeaders: []corev1.HTTPHeader{{Name: "X-Probe", Value: "yes"}, {Name: "Host", Value: "guest.example"}}}
	}
	ok, msg = httpCheck(context.Background(), hg("/healthz"), port, time.Second)
	assert.True(t, ok, msg)
	ok, _ = httpCheck(context.Background(), hg("redirect"), port, time.Second)
	assert.True(t, ok, "3xx is success, not followed")
	ok, msg = httpCheck(context.Background(), hg("/down"), port, time.Second)
	assert.False(t, ok)
	assert.Equal(t, "HTTP probe failed with statuscode: 503", msg)
	ok, msg = httpCheck(context.Background(), hg("/healthz"), refused, time.Second)
	assert.False(t, ok)
	assert.Contains(t, msg, "nothing listening on guest port 8080")
}

// listenTCP serves loopback connections: kept open, or closed at once.
func listenTCP(t *testing.T, closeAtOnce bool) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	var mu sync.Mutex
	var conns []net.Conn
	t.Cleanup(func() {
		l.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			if closeAtOnce {
				c.Close()
				continue
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
	}()
	return l.Addr().(*net.TCPAddr).Port
}

// simCheck is one simulated check: when it began, whether regular, and
// its outcome.
type simCheck struct {
	at          time.Duration
	regular, ok bool
}

// simulateProbe runs a probeSchedule as runProbe does, with checks that
// each take took(began), cut at their timeout (timeoutOf: failed), and
// pass when they begin at readyAt or later, until limit; it returns the
// checks begun, in order, and when the first counted success ended (-1:
// none).
func simulateProbe(s probeSchedule, took func(time.Duration) time.Duration, readyAt, limit time.Duration) ([]simCheck, time.Duration) {
	type end struct {
		at time.Duration
		c  simCheck
	}
	var out []simCheck
	var running []end
	now, firstOK := time.Duration(0), time.Duration(-1)
	for now < limit {
		at, regular, ok := s.next(now)
		// The earliest end of a running check.
		ei := -1
		for i, e := range running {
			if ei < 0 || e.at < running[ei].at {
				ei = i
			}
		}
		if ok && (ei < 0 || at < running[ei].at) {
			if at >= limit {
				break
			}
			now = at
			d := took(at)
			c := simCheck{at, regular, at >= readyAt && d <= s.timeoutOf(regular)}
			out = append(out, c)
			s = s.began(at, regular)
			running = append(running, end{at + min(d, s.timeoutOf(regular)), c})
			continue
		}
		if ei < 0 {
			break
		}
		e := running[ei]
		running = append(running[:ei], running[ei+1:]...)
		now = e.at
		s = s.done(e.c.at, e.c.regular, e.c.ok)
		if e.c.ok && firstOK < 0 && s.counts(e.c.regular, e.c.ok) {
			firstOK = e.at
		}
	}
	return out, firstOK
}

// TestProbeScheduleEarlyUntilFirstSuccess: a readiness probe of period 1 s
// begins an early check every probeFastInterval until its first success,
// beside the regular checks (the only ones counted as failures), then
// checks every period from that success.
func TestProbeScheduleEarlyUntilFirstSuccess(t *testing.T) {
	ms := time.Millisecond
	checks, firstOK := simulateProbe(newProbeSchedule(time.Second, time.Second, true, 0), func(time.Duration) time.Duration { return 10 * ms }, 2550*ms, 5*time.Second)
	var regular, early []time.Duration
	for _, c := range checks {
		if c.regular {
			regular = append(regular, c.at)
		} else {
			early = append(early, c.at)
		}
	}
	// The guest answers from 2.55 s: the early check begun at 2.6 s sees it.
	if firstOK != 2610*ms {
		t.Errorf("first success at %v, want 2.61s (checks %v)", firstOK, checks)
	}
	// Regular checks: 0, 1, 2 s (failures, counted), then a period after the success.
	if want := []time.Duration{0, time.Second, 2 * time.Second, 3600 * ms, 4600 * ms}; !slices.Equal(regular, want) {
		t.Errorf("regular checks at %v, want %v", regular, want)
	}
	// Early checks every 100 ms (the regular ones included in the count of steps), none after the success.
	if len(early) != 26 {
		t.Errorf("%d early checks, want 26 (0.1 .. 2.6 s): %v", len(early), early)
	}
	for i, at := range early {
		if want := time.Duration(i+1) * 100 * ms; at != want {
			t.Errorf("early check %d at %v, want %v", i, at, want)
		}
	}
}

// TestProbeScheduleOverlappingEarlyChecks: early checks that hang (a guest
// whose network is not up answers nothing until the timeout) do not hold
// back the next one: a new one begins every probeFastInterval up to
// maxEarly at once, and the port opening is seen within about
// probeFastInterval plus the answer's time.
func TestProbeScheduleOverlappingEarlyChecks(t *testing.T) {
	ms := time.Millisecond
	readyAt := 1550 * ms
	// Before 1.5 s a check hangs for the whole timeout (1 s); after, the guest answers in 300 ms.
	took := func(at time.Duration) time.Duration {
		if at < 1500*ms {
			return time.Second
		}
		return 300 * ms
	}
	s := newProbeSchedule(time.Second, time.Second, true, 0)
	if s.maxEarly != 10 {
		t.Fatalf("maxEarly = %d for a 1 s timeout, want 10", s.maxEarly)
	}
	checks, firstOK := simulateProbe(s, took, readyAt, 4*time.Second)
	// The early check begun at 1.6 s passes and ends 300 ms later.
	if firstOK != 1900*ms {
		t.Errorf("first success at %v, want 1.9s: %v", firstOK, checks)
	}
	// At most maxEarly early checks ran at once: with checks of 1 s every
	// 100 ms, the 10th (at 1.0 s) fills the slots: the next begins as the
	// first ends (1.1 s).
	var early []time.Duration
	for _, c := range checks {
		if !c.regular && c.at < 1200*ms {
			early = append(early, c.at)
		}
	}
	if want := []time.Duration{100 * ms, 200 * ms, 300 * ms, 400 * ms, 500 * ms, 600 * ms, 700 * ms, 800 * ms, 900 * ms, 1000 * ms, 1100 * ms}; !slices.Equal(early, want) {
		t.Errorf("early checks before 1.2 s at %v, want %v", early, want)
	}
	// An exec probe: one early check at a time.
	s = newProbeSchedule(time.Second, time.Second, true, 1)
	checks, _ = simulateProbe(s, func(time.Duration) time.Duration { return 250 * ms }, time.Hour, 1100*ms)
	want := []simCheck{{0, true, false}, {100 * ms, false, false}, {350 * ms, false, false}, {600 * ms, false, false}, {850 * ms, false, false}, {time.Second, true, false}}
	if !slices.Equal(checks, want) {
		t.Errorf("exec probe checks %v, want %v", checks, want)
	}
}

// TestProbeScheduleHungEarlyChecksOfALongTimeout: with a 5 s timeout, the
// early checks hung on connections the booting guest never saw end after
// the window of maxEarly checks (1 s), not the timeout: slots free every
// probeFastInterval, and the port answering from 1.55 s is seen by the
// early check begun at 1.6 s, not when the first hung check times out
// (5.1 s). Regular checks keep the probe's timeout.
func TestProbeScheduleHungEarlyChecksOfALongTimeout(t *testing.T) {
	ms := time.Millisecond
	// Before 1.5 s a check hangs (longer than any timeout); after, the guest answers in 300 ms.
	took := func(at time.Duration) time.Duration {
		if at < 1500*ms {
			return time.Minute
		}
		return 300 * ms
	}
	s := newProbeSchedule(time.Second, 5*time.Second, true, 0)
	if s.maxEarly != 10 || s.timeoutOf(false) != time.Second || s.timeoutOf(true) != 5*time.Second {
		t.Fatalf("maxEarly %d, early timeout %v, regular %v; want 10, 1s, 5s", s.maxEarly, s.timeoutOf(false), s.timeoutOf(true))
	}
	checks, firstOK := simulateProbe(s, took, 1550*ms, 8*time.Second)
	if firstOK != 1900*ms {
		t.Errorf("first success at %v, want 1.9s: %v", firstOK, checks)
	}
	// The first regular check hangs its whole 5 s: the next begins then.
	var regular []time.Duration
	for _, c := range checks {
		if c.regular {
			regular = append(regular, c.at)
		}
	}
	if len(regular) < 2 || regular[1] != 5*time.Second {
		t.Errorf("regular checks at %v, want the second at 5s", regular)
	}
	// A guest answering slower than the window: only a regular check sees it.
	slow := func(time.Duration) time.Duration { return 1500 * ms }
	checks, firstOK = simulateProbe(s, slow, 0, 8*time.Second)
	if firstOK != 1500*ms || !checks[0].regular || !checks[0].ok {
		t.Errorf("answers of 1.5 s: first success at %v (want 1.5s, the regular check at 0): %v", firstOK, checks)
	}
	// One early check at a time (exec) keeps the probe's timeout.
	if s := newProbeSchedule(time.Second, 5*time.Second, true, 1); s.timeoutOf(false) != 5*time.Second {
		t.Errorf("exec probe: early timeout %v, want 5s", s.timeoutOf(false))
	}
	// A short timeout is its own window.
	if s := newProbeSchedule(time.Second, 300*ms, true, 0); s.maxEarly != 3 || s.timeoutOf(false) != 300*ms {
		t.Errorf("300 ms timeout: maxEarly %d, early timeout %v; want 3, 300ms", s.maxEarly, s.timeoutOf(false))
	}
}

// TestProbeScheduleKubeletTiming: without early checks (liveness), and for
// a period not above probeFastInterval, a probe checks every period, one
// at a time; a check longer than the period delays the next.
func TestProbeScheduleKubeletTiming(t *testing.T) {
	ms := time.Millisecond
	each := func(time.Duration) time.Duration { return 10 * ms }
	for name, s := range map[string]probeSchedule{
		"liveness":     newProbeSchedule(time.Second, time.Second, false, 0),
		"short period": newProbeSchedule(100*ms, time.Second, true, 0),
	} {
		checks, _ := simulateProbe(s, each, time.Hour, 10*s.period+ms)
		if len(checks) != 11 {
			t.Errorf("%s: %d checks in 10 periods, want 11: %v", name, len(checks), checks)
		}
		for i, c := range checks {
			if !c.regular || c.at != time.Duration(i)*s.period {
				t.Errorf("%s: check %d = %+v, want regular at %v", name, i, c, time.Duration(i)*s.period)
			}
		}
	}
	checks, _ := simulateProbe(newProbeSchedule(time.Second, 3*time.Second, false, 0), func(time.Duration) time.Duration { return 1500 * ms }, time.Hour, 5*time.Second)
	want := []simCheck{{0, true, false}, {1500 * ms, true, false}, {3 * time.Second, true, false}, {4500 * ms, true, false}}
	if !slices.Equal(checks, want) {
		t.Errorf("checks of 1.5 s with a 1 s period: %v, want %v", checks, want)
	}
}

// hangVM is a VM whose forwarded guest port is a loopback listener: what
// a booting guest's port looks like before its network is up.
type hangVM struct {
	guest.VM // nil: only what runProbe uses is implemented
	port     int
	dir      string
	done     chan struct{}
}

func (v *hangVM) Done() <-chan struct{}                              { return v.done }
func (v *hangVM) ForwardPort(context.Context, int, int) (int, error) { return v.port, nil }
func (v *hangVM) RemoveForward(context.Context, int) error           { return nil }
func (v *hangVM) Pid() int                                           { return 1 }
func (v *hangVM) StateDir() string                                   { return v.dir }
func (nopSink) Event(string, string, string)                         {}
func (nopSink) Changed()                                             {}
func (nopSink) Failed(string, string)                                {}

type nopSink struct{}

// TestRunProbeEndsHungEarlyChecks: against a port that accepts and never
// answers, a readiness probe with timeoutSeconds 5 keeps beginning early
// checks while its first checks still wait: the early checks end after
// their window (1 s), not the probe's timeout, so hung ones do not hold
// every slot. The 20th connection comes while one of the first three (the
// regular check begun at once, which waits its 5 s) is open; with the
// probe's timeout on early checks, it could only come once nine checks had
// timed out, the first three among them.
func TestRunProbeEndsHungEarlyChecks(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	var mu sync.Mutex
	accepted, firstOpen, firstOpenAt20 := 0, 0, -1
	var conns []net.Conn
	t.Cleanup(func() {
		l.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			i := accepted
			accepted++
			conns = append(conns, c)
			if i < 3 {
				firstOpen++
			}
			if accepted == 20 {
				firstOpenAt20 = firstOpen
			}
			mu.Unlock()
			go func() { // the client's close ends the read
				_, _ = io.Copy(io.Discard, c)
				if i < 3 {
					mu.Lock()
					firstOpen--
					mu.Unlock()
				}
			}()
		}
	}()
	vm := &hangVM{port: l.Addr().(*net.TCPAddr).Port, dir: t.TempDir(), done: make(chan struct{})}
	c := &corev1.Container{Name: "vm", Ports: []corev1.ContainerPort{{Name: "http", ContainerPort: 8080}}}
	probe := &corev1.Probe{ProbeHandler: corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/", Port: intstr.FromString("http")}},
		PeriodSeconds: 1, TimeoutSeconds: 5, FailureThreshold: 3}
	stop := make(chan struct{})
	ended := make(chan struct{})
	go func() {
		defer close(ended)
		runProbe(context.Background(), vm, c, "Readiness", probe, false, true, stop, nil, nopSink{}, func(bool, string) bool { return true })
	}()
	defer func() { close(stop); <-ended }()
	require.Eventually(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return accepted >= 20
	}, time.Minute, 20*time.Millisecond, "20 probe connections to the hung port")
	mu.Lock()
	defer mu.Unlock()
	assert.Positive(t, firstOpenAt20, "the 20th connection came only after the first three checks ended: hung early checks held every slot")
}
