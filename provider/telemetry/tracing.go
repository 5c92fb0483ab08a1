package telemetry

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
)

// TracerName is the instrumentation scope of the provider's spans.
const TracerName = "github.com/qemu-kubelet/qemu-kubelet/provider"

// Span names: one pod.start per VM start (first start and each restart)
// with one child per phase.
const (
	SpanPodStart  = "pod.start"
	SpanPull      = "pull"
	SpanOverlay   = "overlay"
	SpanQEMUStart = "qemu.start"
	SpanBoot      = "boot"
)

// Telemetry is what the VM pod handler reports about VM starts and exits:
// the Prometheus metrics and OpenTelemetry spans. A nil *Telemetry reports
// nothing (VMsConfig.Telemetry is optional).
type Telemetry struct {
	metrics *Metrics
	tracer  trace.Tracer

	mu sync.Mutex
	// booting: started VMs whose pod waits for its readiness probe; the
	// boot span ends when the pod turns Ready or the VM ends.
	booting map[types.UID]*startAttempt
	// timelines: pods between CreatePod and their first Ready status
	// (timeline.go).
	timelines map[types.UID]*startTimeline
}

// NewTelemetry reports to m (nil: no metrics) and tp (nil: no spans).
func NewTelemetry(m *Metrics, tp trace.TracerProvider) *Telemetry {
	if tp == nil {
		tp = noop.NewTracerProvider()
	}
	return &Telemetry{metrics: m, tracer: tp.Tracer(TracerName), booting: map[types.UID]*startAttempt{}, timelines: map[types.UID]*startTimeline{}}
}

// startAttempt follows one VM start: the pod.start span, its phase spans
// and the start metrics. Phases tile the start: each begins where the
// previous one ended. A nil *startAttempt records nothing.
type startAttempt struct {
	t     *Telemetry
	uid   types.UID
	ctx   context.Context // the start's context: canceled = deleted or shutting down
	sctx  context.Context // carries the pod.start span
	span  trace.Span
	begin time.Time
	probe bool // Ready is gated by a probe: boot is observable

	mu      sync.Mutex
	mark    time.Time // end of the previous phase
	lastErr error
	ended   bool
	running time.Time
	boot    trace.Span
}

// BeginStart opens the pod.start span of a VM start of pod. ctx is the
// start's context (canceled when the pod is deleted).
func (t *Telemetry) BeginStart(ctx context.Context, uid types.UID, pod *corev1.Pod, image string) *startAttempt {
	if t == nil {
		return nil
	}
	t.abandonBoot(uid, errors.New("superseded by a new start"))
	now := time.Now()
	sctx, span := t.tracer.Start(context.WithoutCancel(ctx), SpanPodStart, trace.WithTimestamp(now),
		trace.WithSpanKind(trace.SpanKindInternal),
		trace.WithAttributes(
			attribute.String("k8s.namespace.name", pod.Namespace),
			attribute.String("k8s.pod.name", pod.Name),
			attribute.String("k8s.pod.uid", string(uid)),
			attribute.String("container.image.name", image),
		))
	a := &startAttempt{t: t, uid: uid, ctx: ctx, sctx: sctx, span: span, begin: now, mark: now}
	t.Mark(uid, StepWorker, now) // timeline.go
	if len(pod.Spec.Containers) > 0 {
		c := pod.Spec.Containers[0]
		a.probe = c.ReadinessProbe != nil || c.StartupProbe != nil
	}
	return a
}

// phaseSpan records a finished child span from the previous mark to now
// and moves the mark; it returns the phase's duration.
func (a *startAttempt) phaseSpan(name string, err error, attrs ...attribute.KeyValue) time.Duration {
	now := time.Now()
	a.mu.Lock()
	from := a.mark
	a.mark = now
	a.mu.Unlock()
	_, s := a.t.tracer.Start(a.sctx, name, trace.WithTimestamp(from), trace.WithAttributes(attrs...))
	if err != nil {
		s.RecordError(err)
		s.SetStatus(codes.Error, err.Error())
	}
	s.End(trace.WithTimestamp(now))
	return now.Sub(from)
}

// Pulled records one pull attempt that began at t0 and returned err.
func (a *startAttempt) Pulled(t0 time.Time, err error) {
	if a == nil {
		return
	}
	result := PullResult(err)
	a.mu.Lock()
	a.mark = t0
	if err != nil && result != PullCanceled {
		a.lastErr = err // named when the start ends without a VM
	}
	a.mu.Unlock()
	d := a.phaseSpan(SpanPull, err, attribute.String("result", result))
	a.t.metrics.pulled(result, d.Seconds())
	if err == nil {
		a.t.metrics.phase(PhasePull, d.Seconds())
		a.t.Mark(a.uid, StepImage, t0.Add(d))
	} else {
		a.span.AddEvent("pull failed", trace.WithAttributes(attribute.String("result", result)))
	}
}

// Overlaid records the VM spec and overlay creation that returned err.
func (a *startAttempt) Overlaid(err error) {
	if a == nil {
		return
	}
	d := a.phaseSpan(SpanOverlay, err)
	if err != nil {
		reason := podstatus.ReasonStartError
		if _, ok := errors.AsType[podspec.InvalidSpec](err); ok {
			reason = podstatus.ReasonInvalidVMSpec
		}
		a.t.metrics.startFailed(reason)
		a.end(fmt.Errorf("%s: %w", reason, err))
		return
	}
	a.t.metrics.phase(PhaseOverlay, d.Seconds())
	a.t.Mark(a.uid, StepOverlay, time.Now())
}

// QEMUStarted records the QEMU start that returned vm or err. A started VM
// ends the pod.start span unless a probe gates Ready: then the boot span
// runs until the pod turns Ready (the pod worker's first Ready) or the VM ends (vmExited).
func (a *startAttempt) QEMUStarted(vm StartedVM, err error) {
	if a == nil {
		return
	}
	d := a.phaseSpan(SpanQEMUStart, err)
	a.t.markQEMU(a.uid, vm) // timeline.go
	if err != nil {
		if a.ctx.Err() == nil {
			a.t.metrics.startFailed(podstatus.ReasonStartError)
		}
		a.end(err)
		return
	}
	now := time.Now()
	a.t.metrics.phase(PhaseQEMUStart, d.Seconds())
	a.t.metrics.started(now.Sub(a.begin).Seconds())
	a.span.SetAttributes(attribute.Float64("qemu_kubelet.running_after_seconds", now.Sub(a.begin).Seconds()))
	if !a.probe {
		a.end(nil)
		return
	}
	a.mu.Lock()
	a.running = now
	_, a.boot = a.t.tracer.Start(a.sctx, SpanBoot, trace.WithTimestamp(now))
	a.mu.Unlock()
	a.t.mu.Lock()
	a.t.booting[a.uid] = a
	a.t.mu.Unlock()
}

// Done ends a start that stopped short of a running VM without a recorded
// failure: the pod was deleted or the node is shutting down.
func (a *startAttempt) Done() {
	if a == nil {
		return
	}
	a.mu.Lock()
	pending := !a.ended && a.boot == nil
	err := a.lastErr
	a.mu.Unlock()
	if !pending {
		return
	}
	cause := context.Cause(a.ctx)
	if cause == nil {
		cause = errors.New("start interrupted")
	}
	if err != nil {
		cause = fmt.Errorf("%w (last error: %w)", cause, err)
	}
	a.end(cause)
}

// end ends the pod.start span once, with an error status when err is set.
func (a *startAttempt) end(err error) {
	a.mu.Lock()
	if a.ended {
		a.mu.Unlock()
		return
	}
	a.ended = true
	a.mu.Unlock()
	if err != nil {
		a.span.RecordError(err)
		a.span.SetStatus(codes.Error, err.Error())
	}
	a.span.End()
}

// Booted ends the boot span and the pod.start span: the pod is Ready.
func (a *startAttempt) Booted() {
	now := time.Now()
	a.mu.Lock()
	boot, since := a.boot, a.running
	a.mu.Unlock()
	boot.End(trace.WithTimestamp(now))
	a.t.metrics.phase(PhaseBoot, now.Sub(since).Seconds())
	a.t.metrics.ready(now.Sub(a.begin).Seconds())
	a.span.SetAttributes(attribute.Float64("qemu_kubelet.ready_after_seconds", now.Sub(a.begin).Seconds()))
	a.end(nil)
}

// failBoot ends the boot span and pod.start with err.
func (a *startAttempt) failBoot(err error) {
	a.mu.Lock()
	boot := a.boot
	a.mu.Unlock()
	boot.RecordError(err)
	boot.SetStatus(codes.Error, err.Error())
	boot.End()
	a.end(err)
}

// TakeBooting removes and returns the start of uid waiting for Ready
// (nil: none).
func (t *Telemetry) TakeBooting(uid types.UID) *startAttempt {
	t.mu.Lock()
	defer t.mu.Unlock()
	a := t.booting[uid]
	delete(t.booting, uid)
	return a
}

func (t *Telemetry) abandonBoot(uid types.UID, err error) {
	if a := t.TakeBooting(uid); a != nil {
		a.failBoot(err)
	}
}

// VMExited counts the exit of uid's VM; a start still waiting for Ready
// ends with an error.
func (t *Telemetry) VMExited(uid types.UID, ex qemu.Exit) {
	if t == nil {
		return
	}
	t.metrics.exited(ex.Class)
	t.abandonBoot(uid, fmt.Errorf("VM exited before the pod was Ready (%s: %s)", ex.Class, ex.Reason))
}

// ExporterObserver is the Prometheus side of the exporters (nil: none).
func (t *Telemetry) ExporterObserver() jumpstarter.Observer {
	if t == nil || t.metrics == nil {
		return nil
	}
	return t.metrics
}
