package provider

import (
	"context"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/prometheus/client_golang/prometheus/testutil/promlint"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/oci/ocitest"
	"github.com/qemu-kubelet/qemu-kubelet/provider/internal/podtest"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/qemu-kubelet/qemu-kubelet/provider/telemetry"
	"github.com/qemu-kubelet/qemu-kubelet/provider/vmtest"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// scrape reads url in the Prometheus text format.
func scrape(t *testing.T, url string) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := http.Get(url)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	require.NoError(t, err, "parse /metrics")
	return fams
}

// value is the counter/gauge value (histograms: the sample count) of the
// series of name whose labels include want; 0 when absent.
func value(fams map[string]*dto.MetricFamily, name string, want map[string]string) float64 {
	f := fams[name]
	if f == nil {
		return 0
	}
	var sum float64
next:
	for _, m := range f.GetMetric() {
		for k, v := range want {
			found := false
			for _, l := range m.GetLabel() {
				if l.GetName() == k && l.GetValue() == v {
					found = true
				}
			}
			if !found {
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

// statusLog keeps the last pushed status of each pod.
type statusLog struct {
	mu   sync.Mutex
	last map[types.UID]*corev1.Pod
}

func (s *statusLog) wait(t *testing.T, uid types.UID, timeout time.Duration, what string, ok func(*corev1.Pod) bool) *corev1.Pod {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		s.mu.Lock()
		p := s.last[uid]
		s.mu.Unlock()
		if p != nil && ok(p) {
			return p
		}
		if time.Now().After(deadline) {
			t.Fatalf("pod %s: waiting for %s; last %+v", uid, what, lastState(p))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// spanTree is the ended spans of one trace: the pod.start root of pod uid
// and its children by name.
func spanTree(t *testing.T, sr *tracetest.SpanRecorder, uid string) (sdktrace.ReadOnlySpan, map[string][]sdktrace.ReadOnlySpan) {
	t.Helper()
	var root sdktrace.ReadOnlySpan
	for _, s := range sr.Ended() {
		if s.Name() != telemetry.SpanPodStart {
			continue
		}
		for _, a := range s.Attributes() {
			if a.Key == "k8s.pod.uid" && a.Value.AsString() == uid {
				root = s
			}
		}
	}
	require.NotNil(t, root, "no ended %s span for pod %s", telemetry.SpanPodStart, uid)
	kids := map[string][]sdktrace.ReadOnlySpan{}
	for _, s := range sr.Ended() {
		if s.Parent().SpanID() == root.SpanContext().SpanID() && s.SpanContext().TraceID() == root.SpanContext().TraceID() {
			kids[s.Name()] = append(kids[s.Name()], s)
		}
	}
	return root, kids
}

func attr(s sdktrace.ReadOnlySpan, key string) string {
	for _, a := range s.Attributes() {
		if string(a.Key) == key {
			return a.Value.Emit()
		}
	}
	return ""
}

// TestObservability starts real VMs (QEMU under TCG, images from a real
// registry) with metrics and an in-memory span recorder, scrapes /metrics
// in the text format and checks the counters moved by exactly what
// happened, and checks the span tree of each start.
func TestObservability(t *testing.T) {
	root := t.TempDir()
	vmtest.ReapQEMU(t, root)
	reg := ocitest.StartRegistry(t, ocitest.RegistryOptions{})
	refs := vmtest.PushTestImages(t, reg.Addr)
	imageDir := filepath.Join(root, "images")
	store, err := oci.Open(imageDir, oci.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { store.Close() })

	promReg := prometheus.NewRegistry()
	m, err := telemetry.NewMetrics(promReg)
	require.NoError(t, err)
	sr := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(sr))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })

	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	vms := NewVMs(ctx, VMsConfig{
		NodeName: "n1", NodeIP: "10.1.2.3", StateDir: filepath.Join(root, "state"), Accelerator: "tcg",
		Images: store, ImageDir: imageDir,
		Allocatable:      func() corev1.ResourceList { return podtest.RL("cpu", "8", "memory", "8Gi", "pods", "10") },
		Backoff:          podstatus.Backoff{Initial: time.Second, Max: 4 * time.Second},
		ErrImagePullHold: 300 * time.Millisecond,
		Telemetry:        telemetry.NewTelemetry(m, tp),
		// Every memory knob on: the guests still boot and answer probes.
		Memory: qemu.MemoryTuning{TCGTranslationBufferMiB: 32, FreePageReporting: true, MemMerge: true},
	})
	promReg.MustRegister(telemetry.StateCollector{VMs: vms, Images: store}, collectors.NewGoCollector())
	srv := httptest.NewServer(promhttp.HandlerFor(promReg, promhttp.HandlerOpts{}))
	t.Cleanup(srv.Close)
	url := srv.URL + "/metrics"
	sl := &statusLog{last: map[types.UID]*corev1.Pod{}}
	vms.NotifyPods(ctx, func(p *corev1.Pod) {
		sl.mu.Lock()
		sl.last[p.UID] = p
		sl.mu.Unlock()
	})

	t.Run("LintClean", func(t *testing.T) {
		fams := scrape(t, url)
		var mfs []*dto.MetricFamily
		for _, f := range fams {
			mfs = append(mfs, f)
		}
		problems, err := promlint.NewWithMetricFamilies(mfs).Lint()
		require.NoError(t, err)
		assert.Empty(t, problems)
		for _, n := range []string{telemetry.MetricImagePulls, telemetry.MetricVMExits, telemetry.MetricVMStartFailures, telemetry.MetricVMsRunning, telemetry.MetricImageCacheSize, telemetry.MetricImageCacheImages, telemetry.MetricVMsMemoryRSS, telemetry.MetricVMsMemoryPSS} {
			assert.Contains(t, fams, n, "exposed from the start")
		}
	})

	t.Run("StartBootStop", func(t *testing.T) {
		before := scrape(t, url)
		pod := podFor("o-boot", refs[vmtest.VariantACPI], corev1.RestartPolicyAlways, nil)
		pod.Spec.Containers[0].Ports = []corev1.ContainerPort{{Name: "http", ContainerPort: 8080}}
		pod.Spec.Containers[0].ReadinessProbe = &corev1.Probe{
			ProbeHandler:  corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/", Port: intstr.FromString("http")}},
			PeriodSeconds: 1, TimeoutSeconds: 1, FailureThreshold: 3,
		}
		require.NoError(t, vms.CreatePod(ctx, pod))
		sl.wait(t, pod.UID, 120*time.Second, "Ready", func(p *corev1.Pod) bool { return running(p) && podstatus.Ready(p) })

		up := scrape(t, url)
		delta := func(name string, labels map[string]string) float64 {
			return value(up, name, labels) - value(before, name, labels)
		}
		assert.Equal(t, 1.0, delta(telemetry.MetricImagePulls, map[string]string{"result": telemetry.PullSuccess}))
		assert.Equal(t, 1.0, delta(telemetry.MetricImagePulls, nil), "one pull in all")
		assert.Equal(t, 1.0, delta(telemetry.MetricImagePullDuration, map[string]string{"result": telemetry.PullSuccess}))
		assert.Equal(t, 1.0, delta(telemetry.MetricVMStarts, nil))
		assert.Equal(t, 0.0, delta(telemetry.MetricVMStartFailures, nil))
		assert.Equal(t, 1.0, delta(telemetry.MetricVMStartDuration, nil))
		assert.Equal(t, 1.0, delta(telemetry.MetricVMReadyDuration, nil))
		for _, ph := range []string{telemetry.PhasePull, telemetry.PhaseOverlay, telemetry.PhaseQEMUStart, telemetry.PhaseBoot} {
			assert.Equal(t, 1.0, delta(telemetry.MetricVMStartPhaseSeconds, map[string]string{"phase": ph}), "phase %s", ph)
		}
		assert.Equal(t, 1.0, value(up, telemetry.MetricVMsRunning, nil))
		assert.Equal(t, 1.0, value(up, telemetry.MetricImageCacheImages, nil))
		assert.Equal(t, 1.0, value(up, telemetry.MetricImageCacheInUse, nil))
		assert.Greater(t, value(up, telemetry.MetricImageCacheSize, nil), 1e6, "kernel + initrd are megabytes")
		rss, pss := value(up, telemetry.MetricVMsMemoryRSS, nil), value(up, telemetry.MetricVMsMemoryPSS, nil)
		assert.Greater(t, rss, float64(64<<20), "a booted VM's QEMU holds tens of MiB")
		assert.Greater(t, pss, float64(32<<20))
		assert.LessOrEqual(t, pss, rss, "PSS never exceeds RSS")

		rootSpan, kids := spanTree(t, sr, "o-boot")
		assert.Equal(t, codes.Unset, rootSpan.Status().Code, "a start that reached Ready: %+v", rootSpan.Status())
		assert.Equal(t, "default", attr(rootSpan, "k8s.namespace.name"))
		assert.Equal(t, "vm-o-boot", attr(rootSpan, "k8s.pod.name"))
		assert.Equal(t, refs[vmtest.VariantACPI], attr(rootSpan, "container.image.name"))
		order := []string{telemetry.SpanPull, telemetry.SpanOverlay, telemetry.SpanQEMUStart, telemetry.SpanBoot}
		for i, n := range order {
			require.Len(t, kids[n], 1, "one %s span under pod.start; children: %v", n, kids)
			s := kids[n][0]
			assert.Equal(t, codes.Unset, s.Status().Code, "%s", n)
			assert.False(t, s.StartTime().Before(rootSpan.StartTime()), "%s starts within pod.start", n)
			assert.False(t, s.EndTime().After(rootSpan.EndTime()), "%s ends within pod.start", n)
			if i > 0 {
				assert.False(t, s.StartTime().Before(kids[order[i-1]][0].EndTime()), "%s follows %s", n, order[i-1])
			}
		}
		assert.Equal(t, telemetry.PullSuccess, attr(kids[telemetry.SpanPull][0], "result"))
		assert.Greater(t, kids[telemetry.SpanBoot][0].EndTime().Sub(kids[telemetry.SpanBoot][0].StartTime()), 100*time.Millisecond,
			"boot lasts until the guest answers the probe")

		require.NoError(t, vms.DeletePod(ctx, deleting(pod)))
		sl.wait(t, pod.UID, 60*time.Second, "terminated", func(p *corev1.Pod) bool { return terminated(p) != nil })
		require.Eventually(t, func() bool { return vms.RunningVMs() == 0 }, 10*time.Second, 50*time.Millisecond)
		down := scrape(t, url)
		assert.Equal(t, 1.0, value(down, telemetry.MetricVMExits, map[string]string{"class": "guest-shutdown"})-value(before, telemetry.MetricVMExits, map[string]string{"class": "guest-shutdown"}),
			"the ACPI image powers off on delete")
		assert.Equal(t, 1.0, value(down, telemetry.MetricVMExits, nil)-value(before, telemetry.MetricVMExits, nil))
		assert.Equal(t, 0.0, value(down, telemetry.MetricVMsRunning, nil))
		assert.Equal(t, 0.0, value(down, telemetry.MetricImageCacheInUse, nil), "released with the pod")
	})

	t.Run("PanicCountsExitClass", func(t *testing.T) {
		before := scrape(t, url)
		pod := podFor("o-panic", refs[vmtest.VariantPanic], corev1.RestartPolicyNever, nil)
		require.NoError(t, vms.CreatePod(ctx, pod))
		sl.wait(t, pod.UID, 120*time.Second, "Failed", func(p *corev1.Pod) bool { return p.Status.Phase == corev1.PodFailed })
		after := scrape(t, url)
		panicked := map[string]string{"class": "panicked"}
		assert.Equal(t, 1.0, value(after, telemetry.MetricVMExits, panicked)-value(before, telemetry.MetricVMExits, panicked))
		assert.Equal(t, 1.0, value(after, telemetry.MetricVMExits, nil)-value(before, telemetry.MetricVMExits, nil))
		assert.Equal(t, 1.0, value(after, telemetry.MetricVMStarts, nil)-value(before, telemetry.MetricVMStarts, nil))
		assert.Equal(t, 0.0, value(after, telemetry.MetricVMReadyDuration, nil)-value(before, telemetry.MetricVMReadyDuration, nil), "no probe: Ready is not a boot")
		// No probe: pod.start ends when QEMU runs, without a boot span.
		rootSpan, kids := spanTree(t, sr, "o-panic")
		assert.Equal(t, codes.Unset, rootSpan.Status().Code)
		assert.Len(t, kids[telemetry.SpanQEMUStart], 1)
		assert.Empty(t, kids[telemetry.SpanBoot])
		require.NoError(t, vms.DeletePod(ctx, deleting(pod)))
		waitGoneDir(t, filepath.Join(root, "state", VMsDirName, "o-panic"), 10*time.Second)
	})

	t.Run("FailedPullMarksSpans", func(t *testing.T) {
		before := scrape(t, url)
		pod := podFor("o-missing", reg.Addr+"/qemu-kubelet/nope:1", corev1.RestartPolicyAlways, nil)
		require.NoError(t, vms.CreatePod(ctx, pod))
		sl.wait(t, pod.UID, 30*time.Second, "ImagePullBackOff", func(p *corev1.Pod) bool {
			w := p.Status.ContainerStatuses[0].State.Waiting
			return w != nil && w.Reason == podstatus.ReasonImagePullBackOff
		})
		require.NoError(t, vms.DeletePod(ctx, deleting(pod)))
		sl.wait(t, pod.UID, 10*time.Second, "terminated", func(p *corev1.Pod) bool { return terminated(p) != nil })
		after := scrape(t, url)
		notFound := map[string]string{"result": "not_found"}
		canceled := map[string]string{"result": telemetry.PullCanceled}
		n := value(after, telemetry.MetricImagePulls, notFound) - value(before, telemetry.MetricImagePulls, notFound)
		nc := value(after, telemetry.MetricImagePulls, canceled) - value(before, telemetry.MetricImagePulls, canceled)
		assert.GreaterOrEqual(t, n, 1.0)
		assert.LessOrEqual(t, nc, 1.0, "at most the attempt in flight at the delete is canceled")
		assert.Equal(t, n+nc, value(after, telemetry.MetricImagePulls, nil)-value(before, telemetry.MetricImagePulls, nil), "every pull of the missing image is not_found (or canceled by the delete)")
		assert.Equal(t, 0.0, value(after, telemetry.MetricVMStarts, nil)-value(before, telemetry.MetricVMStarts, nil))

		rootSpan, kids := spanTree(t, sr, "o-missing")
		assert.Equal(t, codes.Error, rootSpan.Status().Code, "a start that never ran is an error")
		assert.Contains(t, rootSpan.Status().Description, "not found", "names the last pull error")
		require.NotEmpty(t, kids[telemetry.SpanPull])
		assert.Len(t, kids[telemetry.SpanPull], int(n+nc), "one pull span per attempt")
		for _, s := range kids[telemetry.SpanPull] {
			assert.Equal(t, codes.Error, s.Status().Code)
			assert.Contains(t, []string{"not_found", telemetry.PullCanceled}, attr(s, "result"))
			require.NotEmpty(t, s.Events(), "the error is recorded as an exception event")
			assert.Equal(t, "exception", s.Events()[0].Name)
		}
		assert.Empty(t, kids[telemetry.SpanQEMUStart])
	})
}

func TestPullResult(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want string
	}{
		{nil, telemetry.PullSuccess},
		{&oci.PullError{Ref: "r", Kind: oci.ErrNotFound}, "not_found"},
		{&oci.PullError{Ref: "r", Kind: oci.ErrUnauthorized}, "unauthorized"},
		{&oci.PullError{Ref: "r", Kind: oci.ErrRegistryUnavailable}, "registry_unavailable"},
		{&oci.PullError{Ref: "r", Kind: oci.ErrHostileContent}, "hostile_content"},
		{&oci.PullError{Ref: "r", Kind: oci.ErrInvalidReference}, "invalid_reference"},
		{context.Canceled, telemetry.PullCanceled},
		{assert.AnError, telemetry.PullOther},
	} {
		assert.Equal(t, tc.want, telemetry.PullResult(tc.err), "%v", tc.err)
	}
}
