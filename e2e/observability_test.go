package e2e

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"sync"
	"syscall"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	collectortrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/proto"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/qemu-kubelet/qemu-kubelet/e2e/cluster"
	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	"github.com/qemu-kubelet/qemu-kubelet/oci/ocitest"
	"github.com/qemu-kubelet/qemu-kubelet/provider/telemetry"
	"github.com/qemu-kubelet/qemu-kubelet/provider/vmtest"
)

// TestObservability runs the qemu-kubelet binary as the Helm chart does
// (--metrics-bind-address) with OTLP export configured by the standard
// environment variables, against the test API server, a real registry and
// QEMU under TCG: /metrics is scraped in the text format around a pod's
// life and the pod's start arrives at an OTLP receiver as a span tree.
func TestObservability(t *testing.T) {
	prebuild(t, kubeletPkg) // under way while the control plane starts
	c := cluster.StartT(t, cluster.Options{})
	reg := ocitest.StartRegistry(t, ocitest.RegistryOptions{})
	refs := vmtest.PushTestImages(t, reg.Addr)
	bin := buildQemuKubelet(t)
	sink := &obsSpanSink{}
	collector := httptest.NewServer(sink)
	t.Cleanup(collector.Close)

	a := newNodeAgent(t, c, bin, "qk-obs", "tcg", "")
	vmtest.ReapQEMU(t, a.dir)
	t.Cleanup(func() { deleteAllPods(t, c, "default", a.dir) })
	metricsPort := testutil.FreePort(t)
	obsStartAgent(t, a, []string{"--metrics-bind-address=127.0.0.1:" + fmt.Sprint(metricsPort)},
		"OTEL_EXPORTER_OTLP_ENDPOINT="+collector.URL, "OTEL_BSP_SCHEDULE_DELAY=200")
	waitNode(t, c, a.name, 90*time.Second, "Ready=True", readyIs(corev1.ConditionTrue))
	url := fmt.Sprintf("http://127.0.0.1:%d/metrics", metricsPort)

	before := obsScrape(t, url)
	assert.Equal(t, 0.0, obsValue(before, telemetry.MetricVMsRunning, nil))

	pod := vmPodSpec("obs", a.name, refs[vmtest.VariantACPI], corev1.RestartPolicyAlways, nil)
	pod.Spec.Containers[0].Ports = []corev1.ContainerPort{{Name: "http", ContainerPort: 8080}}
	pod.Spec.Containers[0].ReadinessProbe = &corev1.Probe{
		ProbeHandler:  corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/", Port: intstr.FromString("http")}},
		PeriodSeconds: 1, TimeoutSeconds: 1, FailureThreshold: 3,
	}
	ctx := context.Background()
	p, err := c.Client().CoreV1().Pods("default").Create(ctx, pod, metav1.CreateOptions{})
	require.NoError(t, err)
	waitPod(t, c, "default", p.Name, 120*time.Second, "Ready", func(p *corev1.Pod) bool {
		for _, cond := range p.Status.Conditions {
			if cond.Type == corev1.PodReady && cond.Status == corev1.ConditionTrue {
				return true
			}
		}
		return false
	})

	up := obsScrape(t, url)
	delta := func(after map[string]*dto.MetricFamily, name string, labels map[string]string) float64 {
		return obsValue(after, name, labels) - obsValue(before, name, labels)
	}
	assert.Equal(t, 1.0, delta(up, telemetry.MetricImagePulls, map[string]string{"result": "success"}))
	assert.Equal(t, 1.0, delta(up, telemetry.MetricVMStarts, nil))
	assert.Equal(t, 1.0, delta(up, telemetry.MetricVMStartDuration, nil))
	assert.Equal(t, 1.0, delta(up, telemetry.MetricVMReadyDuration, nil))
	assert.Equal(t, 1.0, delta(up, telemetry.MetricVMStartPhaseSeconds, map[string]string{"phase": telemetry.PhaseBoot}))
	assert.Equal(t, 1.0, obsValue(up, telemetry.MetricVMsRunning, nil))
	assert.Equal(t, 1.0, obsValue(up, telemetry.MetricImageCacheImages, nil))
	assert.Greater(t, obsValue(up, telemetry.MetricImageCacheSize, nil), 1e6)
	assert.Greater(t, obsValue(up, "process_resident_memory_bytes", nil), 0.0)

	// The pod.start span tree arrives over OTLP/HTTP.
	var tree map[string]*tracepb.Span
	require.Eventually(t, func() bool {
		tree = sink.tree(string(p.UID))
		return len(tree) == 5
	}, 20*time.Second, 100*time.Millisecond, "pod.start and its 4 phases exported")
	root := tree[telemetry.SpanPodStart]
	for _, n := range []string{telemetry.SpanPull, telemetry.SpanOverlay, telemetry.SpanQEMUStart, telemetry.SpanBoot} {
		s := tree[n]
		require.NotNil(t, s, n)
		assert.Equal(t, root.GetSpanId(), s.GetParentSpanId(), "%s is a child of pod.start", n)
		assert.Equal(t, root.GetTraceId(), s.GetTraceId())
		assert.NotEqual(t, tracepb.Status_STATUS_CODE_ERROR, s.GetStatus().GetCode(), n)
	}
	assert.Equal(t, "qemu-kubelet", sink.resourceAttr("service.name"))
	assert.Equal(t, a.name, sink.resourceAttr("k8s.node.name"))

	require.NoError(t, c.Client().CoreV1().Pods("default").Delete(ctx, p.Name, metav1.DeleteOptions{}))
	waitPodGone(t, c, "default", p.Name, 90*time.Second)
	require.Eventually(t, func() bool {
		return obsValue(obsScrape(t, url), telemetry.MetricVMsRunning, nil) == 0
	}, 30*time.Second, 200*time.Millisecond, "no VM running after the delete")
	down := obsScrape(t, url)
	shutdown := map[string]string{"class": "guest-shutdown"}
	assert.Equal(t, 1.0, delta(down, telemetry.MetricVMExits, shutdown), "the ACPI guest powered off")
	assert.Equal(t, 1.0, delta(down, telemetry.MetricVMExits, nil))
	assert.Equal(t, 0.0, obsValue(down, telemetry.MetricImageCacheInUse, nil))
}

// obsStartAgent starts a (as nodeAgent.start does) with extra flags and
// environment variables; a.kill stops it.
func obsStartAgent(t *testing.T, a *nodeAgent, args []string, env ...string) {
	t.Helper()
	logf, err := os.OpenFile(a.logPath, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600)
	require.NoError(t, err)
	cmd := exec.Command(a.bin, append([]string{"--config", a.configPath, "--kubeconfig", a.kubeconfig, "-v", "2"}, args...)...)
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		logf.Close()
		t.Fatalf("start qemu-kubelet: %v", err)
	}
	done := make(chan struct{})
	a.mu.Lock()
	a.cmd, a.done = cmd, done
	a.mu.Unlock()
	go func() {
		err := cmd.Wait()
		logf.Close()
		a.mu.Lock()
		a.err = err
		a.mu.Unlock()
		close(done)
	}()
}

func obsScrape(t *testing.T, url string) map[string]*dto.MetricFamily {
	t.Helper()
	var fams map[string]*dto.MetricFamily
	require.Eventually(t, func() bool {
		resp, err := http.Get(url)
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return false
		}
		p := expfmt.NewTextParser(model.UTF8Validation)
		fams, err = p.TextToMetricFamilies(resp.Body)
		require.NoError(t, err, "parse %s", url)
		return true
	}, 10*time.Second, 100*time.Millisecond, "scrape %s", url)
	return fams
}

// obsValue sums the series of name whose labels include want (histograms:
// their sample counts).
func obsValue(fams map[string]*dto.MetricFamily, name string, want map[string]string) float64 {
	var sum float64
	f := fams[name]
	if f == nil {
		return 0
	}
next:
	for _, m := range f.GetMetric() {
		for k, v := range want {
			ok := false
			for _, l := range m.GetLabel() {
				ok = ok || (l.GetName() == k && l.GetValue() == v)
			}
			if !ok {
				continue next
			}
		}
		switch {
		case m.Counter != nil:
			sum += m.GetCounter().GetValue()
		case m.Gauge != nil:
			sum += m.GetGauge().GetValue()
		case m.Histogram != nil:
			sum += float64(m.GetHistogram().GetSampleCount())
		}
	}
	return sum
}

// obsSpanSink is an OTLP/HTTP trace receiver (protobuf) keeping every span.
type obsSpanSink struct {
	mu       sync.Mutex
	spans    []*tracepb.Span
	resource map[string]string
}

func (s *obsSpanSink) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != "/v1/traces" {
		http.NotFound(w, r)
		return
	}
	b, err := io.ReadAll(r.Body)
	req := &collectortrace.ExportTraceServiceRequest{}
	if err == nil {
		err = proto.Unmarshal(b, req)
	}
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	s.mu.Lock()
	for _, rs := range req.GetResourceSpans() {
		if s.resource == nil {
			s.resource = map[string]string{}
		}
		for _, kv := range rs.GetResource().GetAttributes() {
			s.resource[kv.GetKey()] = kv.GetValue().GetStringValue()
		}
		for _, ss := range rs.GetScopeSpans() {
			s.spans = append(s.spans, ss.GetSpans()...)
		}
	}
	s.mu.Unlock()
	out, _ := proto.Marshal(&collectortrace.ExportTraceServiceResponse{})
	w.Header().Set("Content-Type", "application/x-protobuf")
	_, _ = w.Write(out)
}

func (s *obsSpanSink) resourceAttr(k string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.resource[k]
}

// tree is the pod.start span of pod uid and its children, by name.
func (s *obsSpanSink) tree(uid string) map[string]*tracepb.Span {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := map[string]*tracepb.Span{}
	var root *tracepb.Span
	for _, sp := range s.spans {
		if sp.GetName() != telemetry.SpanPodStart {
			continue
		}
		for _, kv := range sp.GetAttributes() {
			if kv.GetKey() == "k8s.pod.uid" && kv.GetValue().GetStringValue() == uid {
				root = sp
			}
		}
	}
	if root == nil {
		return out
	}
	out[root.GetName()] = root
	for _, sp := range s.spans {
		if bytes.Equal(sp.GetParentSpanId(), root.GetSpanId()) {
			out[sp.GetName()] = sp
		}
	}
	return out
}
