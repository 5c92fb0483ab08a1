package provider

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/qemu-kubelet/qemu-kubelet/provider/internal/atomicfile"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/qemu-kubelet/qemu-kubelet/provider/telemetry"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	corev1 "k8s.io/api/core/v1"
)

// BenchmarkStartTelemetry: what the metrics and spans of one whole VM
// start (pod.start with pull, overlay, qemu.start, boot, then the exit)
// cost, against the baseline of one status write (atomicfile.WriteJSON of the
// VM state), which every start already does several times. Spans go
// through a batch processor to an in-memory exporter, as in production
// with OTLP.
func BenchmarkStartTelemetry(b *testing.B) {
	reg := prometheus.NewRegistry()
	m, err := telemetry.NewMetrics(reg)
	if err != nil {
		b.Fatal(err)
	}
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp))
	b.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	tel := telemetry.NewTelemetry(m, tp)
	pod := podFor("bench", "registry.example/os:1", corev1.RestartPolicyAlways, nil)
	pod.Spec.Containers[0].ReadinessProbe = &corev1.Probe{}
	ctx := context.Background()
	ex := qemu.Exit{Class: qemu.ExitGuestShutdown}

	start := func() {
		a := tel.BeginStart(ctx, pod.UID, pod, "registry.example/os:1")
		a.Pulled(time.Now(), nil)
		a.Overlaid(nil)
		a.QEMUStarted(nil, nil)
		if got := tel.TakeBooting(pod.UID); got != nil {
			got.Booted()
		}
		a.Done()
		tel.VMExited(pod.UID, ex)
	}
	path := filepath.Join(b.TempDir(), StatusFileName)
	var st podstatus.VMState
	st.SetRunning(time.Now())
	write := func() {
		if err := atomicfile.WriteJSON(path, st); err != nil {
			b.Fatal(err)
		}
	}

	measure := func(f func(), n int) time.Duration {
		t0 := time.Now()
		for i := 0; i < n; i++ {
			f()
		}
		return time.Since(t0) / time.Duration(n)
	}
	var tel0, base time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		tel0 += measure(start, 100)
		base += measure(write, 100)
	}
	b.StopTimer()
	b.ReportMetric(float64(tel0.Nanoseconds())/float64(b.N), "telemetry-ns/start")
	b.ReportMetric(float64(base.Nanoseconds())/float64(b.N), "statuswrite-ns")
	b.ReportMetric(float64(tel0)/float64(base), "x-of-baseline")
	b.ReportMetric(0, "ns/op")
}
