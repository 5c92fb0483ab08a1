package provider

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter"
	"github.com/qemu-kubelet/qemu-kubelet/provider/exporter"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
)

// syncBuffer is a bytes.Buffer safe for concurrent writers.
type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// eventLog is a record.EventRecorder keeping every event (never blocks).
type eventLog struct {
	mu  sync.Mutex
	evs []string
}

func (l *eventLog) Event(_ runtime.Object, typ, reason, msg string) {
	l.mu.Lock()
	l.evs = append(l.evs, typ+" "+reason+" "+msg)
	l.mu.Unlock()
}

func (l *eventLog) Eventf(o runtime.Object, typ, reason, f string, args ...any) {
	l.Event(o, typ, reason, fmt.Sprintf(f, args...))
}

func (l *eventLog) AnnotatedEventf(o runtime.Object, _ map[string]string, typ, reason, f string, args ...any) {
	l.Eventf(o, typ, reason, f, args...)
}

func (l *eventLog) all() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Join(l.evs, "\n")
}

// realExporters runs the jumpstarter package's exporter (as cmd/qemu-kubelet
// does) with short reconnect delays.
var realExporters = exporter.RunnerFunc(func(ctx context.Context, cfg jumpstarter.Config) error {
	cfg.BackoffInitial, cfg.BackoffMax = 200*time.Millisecond, time.Second
	// The test registry is a lab's own, on loopback over plain HTTP.
	cfg.Resources.Fetch = jumpstarter.FetchPolicy{AllowNets: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}, AllowPlainHTTP: true}
	e, err := jumpstarter.New(cfg)
	if err != nil {
		return err
	}
	return e.Run(ctx)
})

func vmStateFile(t *testing.T, dir string) podstatus.VMState {
	t.Helper()
	var st podstatus.VMState
	b, err := os.ReadFile(filepath.Join(dir, StatusFileName))
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(b, &st))
	return st
}

func waitingReason(p *corev1.Pod) string {
	if len(p.Status.ContainerStatuses) == 0 || p.Status.ContainerStatuses[0].State.Waiting == nil {
		return ""
	}
	return p.Status.ContainerStatuses[0].State.Waiting.Reason
}

// countWriter counts what it passes on.
type countWriter struct {
	w io.Writer
	n int64
}

func (c *countWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}

// windowWriter counts what is written and keeps the want bytes from
// offset from.
type windowWriter struct {
	from, want int64
	n          int64
	got        []byte
}

func (w *windowWriter) Write(p []byte) (int, error) {
	start, end := w.n, w.n+int64(len(p))
	if lo, hi := max(start, w.from), min(end, w.from+w.want); lo < hi {
		w.got = append(w.got, p[lo-start:hi-start]...)
	}
	w.n = end
	return len(p), nil
}
