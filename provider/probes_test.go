package provider

import (
	"context"
	"fmt"
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
	applyProbes(s, plain, nil)
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
	applyProbes(s, probed, nil)
	notReady(s)

	ps := &probeState{run: started.Time}
	s = status()
	applyProbes(s, probed, ps)
	notReady(s)
	assert.True(t, ps.set(true, ""))
	assert.False(t, ps.set(true, ""), "no change")
	s = status()
	applyProbes(s, probed, ps)
	assert.True(t, s.ContainerStatuses[0].Ready)
	assert.Equal(t, corev1.ConditionTrue, s.Conditions[2].Status)

	// The previous run's result does not make a new run ready.
	s = status()
	s.ContainerStatuses[0].State.Running.StartedAt = metav1.NewTime(started.Add(time.Minute))
	applyProbes(s, probed, ps)
	notReady(s)

	// A startup probe holds Started and Ready until it succeeded.
	startup := probed.DeepCopy()
	startup.Spec.Containers[0].StartupProbe = &corev1.Probe{}
	st := &probeState{run: started.Time, ready: true}
	s = status()
	applyProbes(s, startup, st)
	notReady(s)
	require.NotNil(t, s.ContainerStatuses[0].Started)
	assert.False(t, *s.ContainerStatuses[0].Started)
	st.setStarted()
	s = status()
	applyProbes(s, startup, st)
	assert.True(t, s.ContainerStatuses[0].Ready)
	assert.True(t, *s.ContainerStatuses[0].Started)
	// Startup probe only: ready once started.
	onlyStartup := plain.DeepCopy()
	onlyStartup.Spec.Containers[0].StartupProbe = &corev1.Probe{}
	s = status()
	applyProbes(s, onlyStartup, &probeState{run: started.Time})
	notReady(s)
	s = status()
	applyProbes(s, onlyStartup, st)
	assert.True(t, s.ContainerStatuses[0].Ready)

	// Not running: untouched.
	s = status()
	s.ContainerStatuses[0].State = corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{}}
	s.ContainerStatuses[0].Ready = false
	applyProbes(s, probed, ps)
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

// simulateProbe runs a probeSchedule as runProbe does, with checks that
// each take took(began) and pass from readyAt on, until the time limit;
// it returns the checks as (began, regular, ok).
type simCheck struct {
	at          time.Duration
	regular, ok bool
}

func simulateProbe(s probeSchedule, took func(time.Duration) time.Duration, readyAt, limit time.Duration) []simCheck {
	var out []simCheck
	now, last := time.Duration(0), time.Duration(-1)
	for {
		at, regular := s.next(last, now)
		if at >= limit {
			return out
		}
		ok := at >= readyAt
		out = append(out, simCheck{at, regular, ok})
		s = s.done(at, regular, ok)
		last, now = at, at+took(at)
	}
}

// TestProbeScheduleEarlyUntilFirstSuccess: a readiness probe of period 1 s
// checks every probeFastInterval until its first success (only the checks
// on the period count as failures), then every period from that success.
func TestProbeScheduleEarlyUntilFirstSuccess(t *testing.T) {
	ms := time.Millisecond
	checks := simulateProbe(newProbeSchedule(time.Second, true), func(time.Duration) time.Duration { return 10 * ms }, 2550*ms, 5*time.Second)
	var regular, early []time.Duration
	var firstOK time.Duration = -1
	for _, c := range checks {
		if c.ok && firstOK < 0 {
			firstOK = c.at
			if c.regular {
				t.Errorf("first success at %v counted as regular", c.at)
			}
		}
		if c.regular {
			regular = append(regular, c.at)
		} else {
			early = append(early, c.at)
		}
	}
	// The guest answers at 2.55 s: seen at 2.6 s (the early check after it), not at 3 s.
	if firstOK != 2600*ms {
		t.Errorf("first success seen at %v, want 2.6s (checks %v)", firstOK, checks)
	}
	// Regular checks: 0, 1, 2 s (failures, counted), then a period after the success.
	want := []time.Duration{0, time.Second, 2 * time.Second, 3600 * ms, 4600 * ms}
	if !slices.Equal(regular, want) {
		t.Errorf("regular checks at %v, want %v", regular, want)
	}
	// Early checks every 100 ms between the regular ones, none after the success.
	if len(early) != 9+9+6 {
		t.Errorf("%d early checks, want 24: %v", len(early), early)
	}
	for _, at := range early {
		if at > firstOK {
			t.Errorf("early check at %v after the first success at %v", at, firstOK)
		}
		if at%(100*ms) != 0 {
			t.Errorf("early check at %v: not on the 100 ms steps", at)
		}
	}
}

// TestProbeScheduleKubeletTiming: without early checks (liveness), and for
// a period not above probeFastInterval, a probe checks every period; a
// check longer than the period delays the next one, which is regular.
func TestProbeScheduleKubeletTiming(t *testing.T) {
	ms := time.Millisecond
	each := func(time.Duration) time.Duration { return 10 * ms }
	for name, s := range map[string]probeSchedule{
		"liveness":     newProbeSchedule(time.Second, false),
		"short period": newProbeSchedule(100*ms, true),
	} {
		checks := simulateProbe(s, each, time.Hour, 10*s.period+ms)
		if len(checks) != 11 {
			t.Errorf("%s: %d checks in 10 periods, want 11: %v", name, len(checks), checks)
		}
		for i, c := range checks {
			if !c.regular || c.at != time.Duration(i)*s.period {
				t.Errorf("%s: check %d = %+v, want regular at %v", name, i, c, time.Duration(i)*s.period)
			}
		}
	}
	// Early checks that time out (1 s, the guest not up): the next begins
	// when one ends, and is regular once a period has passed.
	checks := simulateProbe(newProbeSchedule(time.Second, true), func(time.Duration) time.Duration { return time.Second }, time.Hour, 3500*ms)
	want := []simCheck{{0, true, false}, {time.Second, true, false}, {2 * time.Second, true, false}, {3 * time.Second, true, false}}
	if !slices.Equal(checks, want) {
		t.Errorf("checks of 1 s: %v, want %v", checks, want)
	}
	// Checks of 250 ms: early ones at 250, 500, 750 ms, regular at 1 s.
	checks = simulateProbe(newProbeSchedule(time.Second, true), func(time.Duration) time.Duration { return 250 * ms }, time.Hour, 1100*ms)
	want = []simCheck{{0, true, false}, {250 * ms, false, false}, {500 * ms, false, false}, {750 * ms, false, false}, {time.Second, true, false}}
	if !slices.Equal(checks, want) {
		t.Errorf("checks of 250 ms: %v, want %v", checks, want)
	}
}

// TestProbeScheduleEarlyTimeout: an early check waits at most
// probeEarlyTimeout, a regular one the probe's timeout.
func TestProbeScheduleEarlyTimeout(t *testing.T) {
	s := newProbeSchedule(time.Second, true)
	if got := s.timeout(time.Second, true); got != time.Second {
		t.Errorf("regular check timeout %v, want 1s", got)
	}
	if got := s.timeout(time.Second, false); got != probeEarlyTimeout {
		t.Errorf("early check timeout %v, want %v", got, probeEarlyTimeout)
	}
	if got := s.timeout(100*time.Millisecond, false); got != 100*time.Millisecond {
		t.Errorf("early check timeout with a 100ms probe timeout: %v", got)
	}
}
