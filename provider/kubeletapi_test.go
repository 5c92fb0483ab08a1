package provider

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/virtual-kubelet/virtual-kubelet/errdefs"
	"github.com/virtual-kubelet/virtual-kubelet/node/api"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

func TestRenderHistory(t *testing.T) {
	t0 := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	t1 := t0.Add(time.Minute)
	segs := []consoleSegment{
		{data: []byte("a1\na2\n"), modTime: t0},
		{data: []byte("b1\nb2\nb3 partial"), modTime: t1},
	}
	for _, tc := range []struct {
		name  string
		opts  api.ContainerLogOpts
		since time.Time
		want  string
	}{
		{"all", api.ContainerLogOpts{}, time.Time{}, "a1\na2\nb1\nb2\nb3 partial"},
		{"tail 2", api.ContainerLogOpts{Tail: 2}, time.Time{}, "b2\nb3 partial"},
		{"tail across files", api.ContainerLogOpts{Tail: 4}, time.Time{}, "a2\nb1\nb2\nb3 partial"},
		{"tail more than there is", api.ContainerLogOpts{Tail: 40}, time.Time{}, "a1\na2\nb1\nb2\nb3 partial"},
		{"since drops older file", api.ContainerLogOpts{}, t0.Add(time.Second), "b1\nb2\nb3 partial"},
		{"since after everything", api.ContainerLogOpts{}, t1.Add(time.Second), ""},
		{"timestamps are file mtimes", api.ContainerLogOpts{Timestamps: true, Tail: 4}, time.Time{},
			"2026-01-02T03:04:05Z a2\n2026-01-02T03:05:05Z b1\n2026-01-02T03:05:05Z b2\n2026-01-02T03:05:05Z b3 partial"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := string(renderHistory(segs, tc.opts, tc.since))
			// the partial last line appears with its stamp only once
			if tc.opts.Timestamps {
				assert.Equal(t, strings.Count(tc.want, "2026-"), strings.Count(got, "2026-"))
			}
			assert.Equal(t, tc.want, got)
		})
	}
}

func TestTailStart(t *testing.T) {
	seg := func(ss ...string) []consoleSegment {
		var out []consoleSegment
		for _, s := range ss {
			out = append(out, consoleSegment{data: []byte(s)})
		}
		return out
	}
	render := func(segs []consoleSegment, n int) string {
		return string(renderHistory(segs, api.ContainerLogOpts{Tail: n}, time.Time{}))
	}
	for _, tc := range []struct {
		segs []consoleSegment
		n    int
		want string
	}{
		{seg("\n\nx\n"), 1, "x\n"},
		{seg("\n\nx\n"), 2, "\nx\n"},
		{seg("\n\nx\n"), 3, "\n\nx\n"},
		{seg("\n\nx\n"), 9, "\n\nx\n"},
		{seg("a\nb", "c\n"), 2, "bc\n"}, // a line does not span files
		{seg("a\nb", "c\n"), 3, "a\nbc\n"},
		{seg("a\n", ""), 1, "a\n"},
		{seg("", ""), 1, ""},
	} {
		assert.Equal(t, tc.want, render(tc.segs, tc.n), "%q tail %d", tc.segs, tc.n)
	}
}

func TestLogSince(t *testing.T) {
	now := time.Date(2026, 1, 1, 0, 0, 10, 0, time.UTC)
	assert.Equal(t, now.Add(-5*time.Second), logSince(api.ContainerLogOpts{SinceSeconds: 5}, now))
	at := now.Add(-time.Hour)
	assert.Equal(t, at, logSince(api.ContainerLogOpts{SinceTime: at}, now))
	assert.True(t, logSince(api.ContainerLogOpts{}, now).IsZero())
}

func TestLimitAndStampWriters(t *testing.T) {
	var buf bytes.Buffer
	lw := &limitWriter{w: &buf, left: 5}
	n, err := lw.Write([]byte("abc"))
	assert.Equal(t, 3, n)
	require.NoError(t, err)
	n, err = lw.Write([]byte("defg"))
	assert.Equal(t, 2, n)
	assert.ErrorIs(t, err, errLimitReached)
	_, err = lw.Write([]byte("x"))
	assert.ErrorIs(t, err, errLimitReached)
	assert.Equal(t, "abcde", buf.String())

	buf.Reset()
	at := time.Date(2026, 5, 6, 7, 8, 9, 500, time.UTC)
	sw := &stampWriter{w: &buf, stamp: true, now: func() time.Time { return at }, atStart: true}
	_, err = sw.Write([]byte("one\ntw"))
	require.NoError(t, err)
	_, err = sw.Write([]byte("o\nthree\n"))
	require.NoError(t, err)
	ts := "2026-05-06T07:08:09.0000005Z "
	assert.Equal(t, ts+"one\n"+ts+"two\n"+ts+"three\n", buf.String())
}

// writeConsole fakes a pod state dir's console files with given mtimes.
func writeConsole(t *testing.T, dir, name, content string, mtime time.Time) {
	t.Helper()
	p := filepath.Join(dir, name)
	require.NoError(t, os.WriteFile(p, []byte(content), 0o600))
	require.NoError(t, os.Chtimes(p, mtime, mtime))
}

func TestConsoleLogsFiles(t *testing.T) {
	dir := t.TempDir()
	old := time.Now().Add(-time.Hour)
	writeConsole(t, dir, consoleRotatedName, "rot1\nrot2\n", old)
	writeConsole(t, dir, qemu.ConsoleLogName, "cur1\ncur2\n", time.Now())
	read := func(opts api.ContainerLogOpts) (string, error) {
		rc, err := ConsoleLogs(context.Background(), ConsoleLogSource{Dir: dir, Pod: "ns/p"}, opts)
		if err != nil {
			return "", err
		}
		defer rc.Close()
		b, err := io.ReadAll(rc)
		return string(b), err
	}
	got, err := read(api.ContainerLogOpts{})
	require.NoError(t, err)
	assert.Equal(t, "rot1\nrot2\ncur1\ncur2\n", got)
	got, err = read(api.ContainerLogOpts{SinceSeconds: 60})
	require.NoError(t, err)
	assert.Equal(t, "cur1\ncur2\n", got)
	got, err = read(api.ContainerLogOpts{LimitBytes: 7})
	require.NoError(t, err)
	assert.Equal(t, "rot1\nro", got)
	// Follow without a live VM returns what is kept.
	got, err = read(api.ContainerLogOpts{Follow: true, Tail: 1})
	require.NoError(t, err)
	assert.Equal(t, "cur2\n", got)

	_, err = read(api.ContainerLogOpts{Previous: true})
	require.Error(t, err)
	assert.True(t, errdefs.IsNotFound(err), "previous without a previous run is NotFound: %v", err)
	assert.Contains(t, err.Error(), "ns/p")
	writeConsole(t, dir, qemu.ConsolePreviousLogName, "prev\n", old)
	got, err = read(api.ContainerLogOpts{Previous: true})
	require.NoError(t, err)
	assert.Equal(t, "prev\n", got)
}

func TestConsoleLogsFollow(t *testing.T) {
	dir := t.TempDir()
	writeConsole(t, dir, qemu.ConsoleLogName, "before\n", time.Now())
	done := make(chan struct{})
	rc, err := ConsoleLogs(context.Background(), ConsoleLogSource{Dir: dir, Done: done, Pod: "ns/p"}, api.ContainerLogOpts{Follow: true})
	require.NoError(t, err)
	defer rc.Close()
	f, err := os.OpenFile(filepath.Join(dir, qemu.ConsoleLogName), os.O_APPEND|os.O_WRONLY, 0)
	require.NoError(t, err)
	_, err = f.WriteString("after\n")
	require.NoError(t, err)
	f.Close()
	buf := make([]byte, 64)
	var got []byte
	for !bytes.Contains(got, []byte("after\n")) {
		n, err := rc.Read(buf)
		require.NoError(t, err)
		got = append(got, buf[:n]...)
	}
	assert.Equal(t, "before\nafter\n", string(got))
	close(done) // the VM exited: the stream ends
	rest, err := io.ReadAll(rc)
	require.NoError(t, err)
	assert.Empty(t, rest)
}

func TestConsoleWriterLock(t *testing.T) {
	dir := t.TempDir()
	rel, err := lockConsoleWriter(dir)
	require.NoError(t, err)
	_, err = lockConsoleWriter(dir)
	assert.ErrorIs(t, err, ErrConsoleBusy)
	rel()
	rel2, err := lockConsoleWriter(dir)
	require.NoError(t, err, "the lock is free again once released")
	rel2()
}

// usernetSample is QEMU 7.2's `info usernet` (captured): a forward whose
// guest has not answered yet (18931), and one connection the guest accepted
// (18932).
const usernetSample = `Hub -1 (net0):
  Protocol[State]    FD  Source Address  Port   Dest. Address  Port RecvQ SendQ
  TCP[SYN_SENT]      12       127.0.0.1 18931       10.0.2.15  9999     0     0
  TCP[ESTABLISHED]   13       127.0.0.1 18932       10.0.2.15  8080     0     0
  TCP[FIN_WAIT_2]    14       127.0.0.1 18933       10.0.2.15  8080     0     0
  TCP[HOST_FORWARD]   9       127.0.0.1 18931       10.0.2.15  9999     0     0
  TCP[HOST_FORWARD]   8       127.0.0.1 18932       10.0.2.15  8080     0     0
  TCP[HOST_FORWARD]   7       127.0.0.1 18933       10.0.2.15  8080     0     0
`

func TestGuestAccepted(t *testing.T) {
	assert.False(t, guestAccepted(usernetSample, 18931), "SYN_SENT: no answer yet")
	assert.True(t, guestAccepted(usernetSample, 18932))
	assert.False(t, guestAccepted(usernetSample, 18933), "only an old closing connection")
	assert.False(t, guestAccepted(usernetSample, 1893), "port must match exactly")
	assert.False(t, guestAccepted("", 18932))
}

func TestAwaitGuest(t *testing.T) {
	ctx := context.Background()
	fixed := func(out string) usernetQuery {
		return func(context.Context) (string, error) { return out, nil }
	}
	// QEMU closes the host side: the guest refused.
	a, b := tcpPair(t)
	b.Close()
	_, err := awaitGuest(ctx, fixed(usernetSample), a, 18931, 2*time.Second)
	assert.ErrorIs(t, err, ErrGuestPortClosed)

	// Still SYN_SENT at the deadline: no answer.
	a, _ = tcpPair(t)
	_, err = awaitGuest(ctx, fixed(usernetSample), a, 18931, 200*time.Millisecond)
	assert.ErrorIs(t, err, ErrGuestNoAnswer)

	// Established: accepted, nothing read.
	a, b = tcpPair(t)
	got, err := awaitGuest(ctx, fixed(usernetSample), a, 18932, time.Second)
	require.NoError(t, err)
	assert.Empty(t, got)

	// The guest answers after a while, first with a greeting: kept.
	a, b = tcpPair(t)
	calls := 0
	later := func(context.Context) (string, error) {
		calls++
		if calls == 3 {
			_, _ = b.Write([]byte("SSH-2.0-x\r\n"))
		}
		return usernetSample, nil
	}
	got, err = awaitGuest(ctx, later, a, 18931, 5*time.Second)
	require.NoError(t, err)
	assert.Equal(t, "SSH-2.0-x\r\n", string(got))

	// QEMU cannot be asked: an error naming that.
	a, _ = tcpPair(t)
	_, err = awaitGuest(ctx, func(context.Context) (string, error) { return "", errors.New("QMP gone") }, a, 1, time.Second)
	assert.ErrorContains(t, err, "ask QEMU for the connection state: QMP gone")
}

func TestParseProcStat(t *testing.T) {
	b := []byte("cpu  100 5 50 1000 20 3 2 1 40 0\ncpu0 1 2 3 4 5 6 7 8 9 10\nintr 1\nbtime 1700000000\n")
	c, boot, err := parseProcStat(b)
	require.NoError(t, err)
	// user+nice+system+irq+softirq+steal = 100+5+50+3+2+1 = 161 ticks.
	assert.Equal(t, 1610*time.Millisecond, c.Busy)
	assert.Equal(t, int64(1700000000), boot.Unix())
	_, _, err = parseProcStat([]byte("intr 1\n"))
	assert.Error(t, err)
	_, _, err = parseProcStat([]byte("cpu 1 x 3 4\n"))
	assert.Error(t, err)
}

func statsPod(ns, name, uid string) *corev1.Pod {
	return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, UID: types.UID("u-" + uid)},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "vm"}}}}
}

func TestBuildSummaryAndMetrics(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	t1 := t0.Add(500 * time.Millisecond)
	started := t0.Add(-time.Minute)
	pod := statsPod("default", "vm1", "1")
	h0 := hostSample{cpu: hostCPU{Busy: 10 * time.Second}, at: t0, memTotal: 8 << 30, memAvail: 6 << 30}
	h1 := hostSample{cpu: hostCPU{Busy: 11 * time.Second}, at: t1, memTotal: 8 << 30, memAvail: 5 << 30, boot: t0.Add(-time.Hour)}
	p0 := []podSample{{pod: pod, started: started, cpu: 2 * time.Second, rss: 100 << 20, at: t0}}
	p1 := []podSample{{pod: pod, started: started, cpu: 2250 * time.Millisecond, rss: 120 << 20, pss: 110 << 20, at: t1}}

	s := buildSummary("n1", h0, h1, p0, p1)
	assert.Equal(t, "n1", s.Node.NodeName)
	require.NotNil(t, s.Node.CPU.UsageNanoCores)
	assert.Equal(t, uint64(2e9), *s.Node.CPU.UsageNanoCores, "1s of CPU in 0.5s = 2 cores")
	assert.Equal(t, uint64(3<<30), *s.Node.Memory.WorkingSetBytes)
	require.Len(t, s.Pods, 1)
	ps := s.Pods[0]
	assert.Equal(t, "vm1", ps.PodRef.Name)
	assert.Equal(t, "u-1", ps.PodRef.UID)
	assert.Equal(t, uint64(5e8), *ps.CPU.UsageNanoCores, "0.25s in 0.5s = half a core")
	assert.Equal(t, uint64(2250*time.Millisecond), *ps.CPU.UsageCoreNanoSeconds)
	assert.Equal(t, uint64(110<<20), *ps.Memory.WorkingSetBytes, "working set is QEMU's PSS")
	assert.Equal(t, uint64(120<<20), *ps.Memory.RSSBytes)
	assert.Equal(t, uint64(120<<20), *ps.Memory.UsageBytes)
	require.Len(t, ps.Containers, 1)
	assert.Equal(t, "vm", ps.Containers[0].Name)
	assert.Equal(t, *ps.CPU.UsageNanoCores, *ps.Containers[0].CPU.UsageNanoCores)

	// A pod restarted between the samples has no rate.
	p1r := []podSample{{pod: pod, started: t1, cpu: time.Second, rss: 1, at: t1}}
	assert.Nil(t, buildSummary("n1", h0, h1, p0, p1r).Pods[0].CPU.UsageNanoCores)

	// /metrics/resource: the text metrics-server parses.
	var buf bytes.Buffer
	enc := expfmt.NewEncoder(&buf, expfmt.NewFormat(expfmt.TypeTextPlain))
	for _, mf := range buildMetrics(h1, p1) {
		require.NoError(t, enc.Encode(mf))
	}
	text := buf.String()
	for _, want := range []string{
		`container_cpu_usage_seconds_total{container="vm",namespace="default",pod="vm1"} 2.25 ` + msStr(t1),
		`container_memory_working_set_bytes{container="vm",namespace="default",pod="vm1"} 1.1534336e+08 ` + msStr(t1),
		`qemu_kubelet_vm_memory_rss_bytes{namespace="default",pod="vm1"} 1.2582912e+08 ` + msStr(t1),
		`qemu_kubelet_vm_memory_pss_bytes{namespace="default",pod="vm1"} 1.1534336e+08 ` + msStr(t1),
		`pod_cpu_usage_seconds_total{namespace="default",pod="vm1"} 2.25 ` + msStr(t1),
		`node_cpu_usage_seconds_total 11 ` + msStr(t1),
		`node_memory_working_set_bytes 3.221225472e+09 ` + msStr(t1),
		"resource_scrape_error 0",
		"# TYPE container_cpu_usage_seconds_total counter",
	} {
		assert.Contains(t, text, want)
	}
	// No pods: families without samples are left out (the encoder rejects them).
	buf.Reset()
	for _, mf := range buildMetrics(hostSample{at: t1, cpuErr: errors.New("x"), memErr: errors.New("y")}, nil) {
		require.NoError(t, enc.Encode(mf))
	}
	assert.Equal(t, "# HELP resource_scrape_error 1 if there was an error while getting container metrics, 0 otherwise\n# TYPE resource_scrape_error gauge\nresource_scrape_error 1\n", buf.String())
}

func msStr(t time.Time) string { return strconv.FormatInt(t.UnixMilli(), 10) }

// tcpPair is a connected loopback TCP pair, closed when the test ends.
func tcpPair(t *testing.T) (net.Conn, net.Conn) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	acc := make(chan net.Conn, 1)
	go func() {
		c, _ := l.Accept()
		acc <- c
	}()
	a, err := net.Dial("tcp", l.Addr().String())
	require.NoError(t, err)
	b := <-acc
	require.NotNil(t, b)
	t.Cleanup(func() { a.Close(); b.Close() })
	return a, b
}

// TestViewAndLogErrors: the lookups behind logs/attach/exec/port-forward
// on a pod record (no VM).
func TestViewAndLogErrors(t *testing.T) {
	ctx := context.Background()
	p := NewVMs(ctx, VMsConfig{NodeName: "n1"})
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "web", UID: "u1"},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "vm"}}}}
	rec := &podVM{uid: pod.UID, dir: t.TempDir(), pod: pod, deleteReq: make(chan struct{})}
	rec.state.SetWaiting(podstatus.ReasonErrImagePull, "nope")
	p.pods[pod.UID] = rec

	_, err := p.GetContainerLogs(ctx, "ns", "web", "vm", api.ContainerLogOpts{})
	require.Error(t, err)
	assert.True(t, errdefs.IsInvalidInput(err))
	assert.Equal(t, `container "vm" in pod "web" is waiting to start: ErrImagePull`, err.Error())

	_, err = p.GetContainerLogs(ctx, "ns", "web", "other", api.ContainerLogOpts{})
	assert.True(t, errdefs.IsInvalidInput(err))
	assert.Contains(t, err.Error(), "container other is not valid for pod web")
	_, err = p.GetContainerLogs(ctx, "ns", "nope", "vm", api.ContainerLogOpts{})
	assert.True(t, errdefs.IsNotFound(err))

	err = p.AttachToContainer(ctx, "ns", "web", "vm", nil)
	assert.True(t, errdefs.IsInvalidInput(err))
	assert.Contains(t, err.Error(), "its VM is not running")
	err = p.RunInContainer(ctx, "ns", "web", "vm", []string{"ls"}, nil)
	assert.True(t, errdefs.IsInvalidInput(err))
	assert.Contains(t, err.Error(), "exec in pod ns/web: its VM is not running")
	s1, s2 := tcpPair(t)
	_ = s2
	err = p.PortForward(ctx, "ns", "web", 80, s1)
	assert.True(t, errdefs.IsInvalidInput(err))

	// A VM ran once (now in back-off): logs show what it wrote.
	rec.state.Started = true
	rec.state.SetWaiting(podstatus.ReasonCrashLoopBackOff, "")
	writeConsole(t, rec.dir, qemu.ConsoleLogName, "last run\n", time.Now())
	rc, err := p.GetContainerLogs(ctx, "ns", "web", "", api.ContainerLogOpts{})
	require.NoError(t, err)
	b, _ := io.ReadAll(rc)
	rc.Close()
	assert.Equal(t, "last run\n", string(b))
}
