package telemetry

import (
	"context"
	"errors"
	"fmt"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
)

// Metric names of the node agent (docs/observability.md lists them all).
const (
	MetricImagePulls          = "qemu_kubelet_image_pulls_total"
	MetricImagePullDuration   = "qemu_kubelet_image_pull_duration_seconds"
	MetricImageCacheSize      = "qemu_kubelet_image_cache_size_bytes"
	MetricImageCacheImages    = "qemu_kubelet_image_cache_images"
	MetricImageCacheInUse     = "qemu_kubelet_image_cache_images_in_use"
	MetricVMStarts            = "qemu_kubelet_vm_starts_total"
	MetricVMStartFailures     = "qemu_kubelet_vm_start_failures_total"
	MetricVMExits             = "qemu_kubelet_vm_exits_total"
	MetricVMStartDuration     = "qemu_kubelet_vm_start_duration_seconds"
	MetricVMReadyDuration     = "qemu_kubelet_vm_ready_duration_seconds"
	MetricVMStartPhaseSeconds = "qemu_kubelet_vm_start_phase_duration_seconds"
	MetricVMsRunning          = "qemu_kubelet_vms_running"
	// Host memory of the VMs, summed over the VMs the node supervises
	// (/metrics; per pod: stats.MetricVMMemoryRSS and
	// stats.MetricVMMemoryPSS on the kubelet API's /metrics/resource,
	// which is behind authorization: pod names stay off the open endpoint).
	MetricVMsMemoryRSS = "qemu_kubelet_vms_memory_rss_bytes"
	MetricVMsMemoryPSS = "qemu_kubelet_vms_memory_pss_bytes"

	// Jumpstarter exporters (provider/exporter).
	MetricJumpstarterRegistrations = "qemu_kubelet_jumpstarter_registrations_total"
	MetricJumpstarterDriverCalls   = "qemu_kubelet_jumpstarter_driver_calls_total"
	MetricJumpstarterStreamsActive = "qemu_kubelet_jumpstarter_streams_active"
)

// Start phases (label phase of MetricVMStartPhaseSeconds, child spans of
// pod.start).
const (
	PhasePull      = "pull"
	PhaseOverlay   = "overlay"
	PhaseQEMUStart = "qemu_start"
	PhaseBoot      = "boot"
)

// Pull results (label result of the pull metrics): one per oci error kind,
// plus success, canceled and error (anything unclassified).
const (
	PullSuccess  = "success"
	PullCanceled = "canceled"
	PullOther    = "error"
)

var pullKinds = []struct {
	kind   error
	result string
}{
	{oci.ErrNotFound, "not_found"},
	{oci.ErrUnauthorized, "unauthorized"},
	{oci.ErrRegistryUnavailable, "registry_unavailable"},
	{oci.ErrUnsupportedArtifact, "unsupported_artifact"},
	{oci.ErrHostileContent, "hostile_content"},
	{oci.ErrTooLarge, "too_large"},
	{oci.ErrDigestMismatch, "digest_mismatch"},
	{oci.ErrInvalidReference, "invalid_reference"},
}

// PullResult is the result label of a pull that returned err.
func PullResult(err error) string {
	if err == nil {
		return PullSuccess
	}
	for _, k := range pullKinds {
		if errors.Is(err, k.kind) {
			return k.result
		}
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return PullCanceled
	}
	return PullOther
}

// Buckets of the start histograms: a TCG boot takes seconds, a KVM start
// with a cached image well under one; pulls of multi-GB images minutes.
var (
	startBuckets = []float64{0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300}
	pullBuckets  = []float64{0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800}
)

// Metrics are the node agent's Prometheus metrics about image pulls and VM
// starts and exits. A nil *Metrics records nothing.
type Metrics struct {
	pulls           *prometheus.CounterVec
	pullDuration    *prometheus.HistogramVec
	vmStarts        prometheus.Counter
	vmStartFailures *prometheus.CounterVec
	vmExits         *prometheus.CounterVec
	startDuration   prometheus.Histogram
	readyDuration   prometheus.Histogram
	phaseDuration   *prometheus.HistogramVec

	JSRegistrations *prometheus.CounterVec
	JSDriverCalls   *prometheus.CounterVec
	JSStreams       *prometheus.GaugeVec
}

// RegisterMetrics registers with reg what the node agent's /metrics
// serves besides StateCollector: the Go runtime and process collectors and
// the metrics of NewMetrics, which it returns. (The chart's Grafana
// dashboard is checked against what this registers.)
func RegisterMetrics(reg prometheus.Registerer) (*Metrics, error) {
	for _, c := range []prometheus.Collector{collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{})} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("register runtime metrics: %w", err)
		}
	}
	return NewMetrics(reg)
}

// NewMetrics creates the metrics and registers them with reg.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		pulls: prometheus.NewCounterVec(prometheus.CounterOpts{Name: MetricImagePulls,
			Help: "Image pulls by result: success, canceled, error or the oci error kind (not_found, unauthorized, registry_unavailable, ...). A pull served from the cache counts as success."},
			[]string{"result"}),
		pullDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: MetricImagePullDuration,
			Help: "Duration of image pulls (including cache hits) by result.", Buckets: pullBuckets},
			[]string{"result"}),
		vmStarts: prometheus.NewCounter(prometheus.CounterOpts{Name: MetricVMStarts,
			Help: "QEMU processes started for pods (first starts and restarts)."}),
		vmStartFailures: prometheus.NewCounterVec(prometheus.CounterOpts{Name: MetricVMStartFailures,
			Help: "VM starts that failed after the image was pulled, by reason (the container status reason: StartError, InvalidVMSpec)."},
			[]string{"reason"}),
		vmExits: prometheus.NewCounterVec(prometheus.CounterOpts{Name: MetricVMExits,
			Help: "VM exits by class: guest-shutdown, panicked, crashed, killed (deliberate stops of deleted pods included)."},
			[]string{"class"}),
		startDuration: prometheus.NewHistogram(prometheus.HistogramOpts{Name: MetricVMStartDuration,
			Help: "Time from the start of a pod's VM start (pull check included) to QEMU running.", Buckets: startBuckets}),
		readyDuration: prometheus.NewHistogram(prometheus.HistogramOpts{Name: MetricVMReadyDuration,
			Help: "Time from the start of a pod's VM start to the pod Ready: the guest booted (pods with a readiness or startup probe only).", Buckets: startBuckets}),
		phaseDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: MetricVMStartPhaseSeconds,
			Help: "Duration of each phase of a VM start: pull, overlay, qemu_start, boot (QEMU running to pod Ready; pods with a readiness or startup probe only).", Buckets: startBuckets},
			[]string{"phase"}),
		JSRegistrations: prometheus.NewCounterVec(prometheus.CounterOpts{Name: MetricJumpstarterRegistrations,
			Help: "Register calls of the node's Jumpstarter exporters with their controller, by result: success, token_rejected, permission_denied, no_exporter, temporary or canceled."},
			[]string{"result"}),
		JSDriverCalls: prometheus.NewCounterVec(prometheus.CounterOpts{Name: MetricJumpstarterDriverCalls,
			Help: "Driver calls served by the node's Jumpstarter exporters, by driver name (root for the root driver), method and gRPC status code (OK, NotFound, ...)."},
			[]string{"driver", "method", "code"}),
		JSStreams: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: MetricJumpstarterStreamsActive,
			Help: "Byte streams (console, guest TCP, flashed or dumped files) open through the node's Jumpstarter exporters, by kind."},
			[]string{"kind"}),
	}
	for _, c := range []prometheus.Collector{m.pulls, m.pullDuration, m.vmStarts, m.vmStartFailures, m.vmExits, m.startDuration, m.readyDuration, m.phaseDuration,
		m.JSRegistrations, m.JSDriverCalls, m.JSStreams} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("register node agent metrics: %w", err)
		}
	}
	// Known label values start at 0 so rate() and absent() work from the
	// first scrape.
	for _, r := range []string{PullSuccess, "not_found", "unauthorized", "registry_unavailable"} {
		m.pulls.WithLabelValues(r)
	}
	for _, c := range []qemu.ExitClass{qemu.ExitGuestShutdown, qemu.ExitPanicked, qemu.ExitCrashed, qemu.ExitKilled} {
		m.vmExits.WithLabelValues(string(c))
	}
	for _, r := range []string{podstatus.ReasonStartError, podstatus.ReasonInvalidVMSpec} {
		m.vmStartFailures.WithLabelValues(r)
	}
	for _, ph := range []string{PhasePull, PhaseOverlay, PhaseQEMUStart, PhaseBoot} {
		m.phaseDuration.WithLabelValues(ph)
	}
	m.JSRegistrations.WithLabelValues(PullSuccess)
	return m, nil
}

func (m *Metrics) pulled(result string, seconds float64) {
	if m == nil {
		return
	}
	m.pulls.WithLabelValues(result).Inc()
	m.pullDuration.WithLabelValues(result).Observe(seconds)
}

func (m *Metrics) phase(phase string, seconds float64) {
	if m == nil {
		return
	}
	m.phaseDuration.WithLabelValues(phase).Observe(seconds)
}

func (m *Metrics) started(seconds float64) {
	if m == nil {
		return
	}
	m.vmStarts.Inc()
	m.startDuration.Observe(seconds)
}

func (m *Metrics) ready(seconds float64) {
	if m == nil {
		return
	}
	m.readyDuration.Observe(seconds)
}

func (m *Metrics) startFailed(reason string) {
	if m == nil {
		return
	}
	m.vmStartFailures.WithLabelValues(reason).Inc()
}

func (m *Metrics) exited(class qemu.ExitClass) {
	if m == nil {
		return
	}
	m.vmExits.WithLabelValues(string(class)).Inc()
}

// Registration counts a Register attempt (jumpstarter.Observer).
func (m *Metrics) Registration(err error) {
	if m == nil {
		return
	}
	m.JSRegistrations.WithLabelValues(RegistrationResult(err)).Inc()
}

// RegistrationResult is the result label of a Register that returned err:
// success, canceled, or jumpstarter.FailureReason's name of the failure.
func RegistrationResult(err error) string {
	if err == nil {
		return PullSuccess
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return PullCanceled
	}
	return jumpstarter.FailureReason(err)
}

// DriverCall counts a driver call (jumpstarter.Observer).
func (m *Metrics) DriverCall(driver, method, code string) {
	if m == nil {
		return
	}
	if driver == "" {
		driver = "root"
	}
	m.JSDriverCalls.WithLabelValues(driver, method, code).Inc()
}

// StreamOpened and StreamClosed track open byte streams (jumpstarter.Observer).
func (m *Metrics) StreamOpened(kind string) {
	if m == nil {
		return
	}
	m.JSStreams.WithLabelValues(kind).Inc()
}

// StreamClosed: see StreamOpened.
func (m *Metrics) StreamClosed(kind string) {
	if m == nil {
		return
	}
	m.JSStreams.WithLabelValues(kind).Dec()
}

// StateCollector reports, at scrape time, the state the node holds: VMs
// running and the image cache. Register it with the registry serving
// /metrics; either field may be nil.
type StateCollector struct {
	VMs    Pods
	Images *oci.Store
}

// Pods is what the collector reads of the node's pods (provider.VMs).
type Pods interface {
	// RunningVMs counts the pods whose QEMU process the node supervises.
	RunningVMs() int
	// MemoryUse sums the resident set and the proportional set size (what
	// the VMs cost the host, pages shared between them counted once) of
	// the running VMs' QEMU processes.
	MemoryUse() (rss, pss int64)
}

var (
	descVMsRunning = prometheus.NewDesc(MetricVMsRunning, "QEMU processes the node currently supervises (started or adopted).", nil, nil)
	descCacheSize  = prometheus.NewDesc(MetricImageCacheSize, "Bytes on disk of the cached OS images.", nil, nil)
	descCacheCount = prometheus.NewDesc(MetricImageCacheImages, "OS images in the cache.", nil, nil)
	descCacheInUse = prometheus.NewDesc(MetricImageCacheInUse, "Cached OS images held by at least one pod (never garbage collected).", nil, nil)
	descVMsRSS     = prometheus.NewDesc(MetricVMsMemoryRSS, "Resident memory of all QEMU processes the node supervises (guest RAM they touched and QEMU's own), summed; shared pages count once per VM.", nil, nil)
	descVMsPSS     = prometheus.NewDesc(MetricVMsMemoryPSS, "Proportional set size of all QEMU processes the node supervises, summed: what the VMs cost the host's memory, pages shared between them (KSM) counted once.", nil, nil)
)

// Describe implements prometheus.Collector.
func (c StateCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descVMsRunning
	ch <- descCacheSize
	ch <- descCacheCount
	ch <- descCacheInUse
	ch <- descVMsRSS
	ch <- descVMsPSS
}

// Collect implements prometheus.Collector.
func (c StateCollector) Collect(ch chan<- prometheus.Metric) {
	if c.VMs != nil {
		ch <- prometheus.MustNewConstMetric(descVMsRunning, prometheus.GaugeValue, float64(c.VMs.RunningVMs()))
		rss, pss := c.VMs.MemoryUse()
		ch <- prometheus.MustNewConstMetric(descVMsRSS, prometheus.GaugeValue, float64(rss))
		ch <- prometheus.MustNewConstMetric(descVMsPSS, prometheus.GaugeValue, float64(pss))
	}
	if c.Images != nil {
		var size int64
		inUse := 0
		imgs := c.Images.List()
		for _, i := range imgs {
			size += i.Size
			if i.InUse > 0 {
				inUse++
			}
		}
		ch <- prometheus.MustNewConstMetric(descCacheSize, prometheus.GaugeValue, float64(size))
		ch <- prometheus.MustNewConstMetric(descCacheCount, prometheus.GaugeValue, float64(len(imgs)))
		ch <- prometheus.MustNewConstMetric(descCacheInUse, prometheus.GaugeValue, float64(inUse))
	}
}
