package e2e

import (
	"fmt"
	"math"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/provider/telemetry"
)

// The per-pod timeline of BenchmarkBurst: where a burst's time goes, from
// the Create call to the Ready seen by a watch. The bench's own clock gives
// created (Create returned), bound (the watch saw spec.nodeName) and ready
// (the watch saw Ready=True); the agent's log gives the node's steps (the
// provider's "Start timeline" line, provider/telemetry/timeline.go, at
// -vmodule=timeline=2) and the status write (client-go's "Response" line of
// the PATCH (or PUT) .../pods/<name>/status that carried Ready, at
// -vmodule=round_trippers=6). All on one host: one clock.

// burstSteps are the timeline's steps in order. Those between bound and
// written are the provider's (provider.TimelineStep names).
var burstSteps = []string{
	"created", "bound",
	"createPod", "admitted", "recorded", "worker", "image", "overlay",
	"qemuExec", "qmpSocket", "qmp", "started", "pushed", "delivered",
	"written", "ready",
}

// burstPod is one pod's steps (zero: not seen) and its status write
// conflicts.
type burstPod struct {
	at        map[string]time.Time
	conflicts int
}

// burstHop is one step over all pods: the hop from the step before it
// (mean and max over pods, in ms) and when the last pod passed it (ms from
// the burst's start).
type burstHop struct {
	step          string
	pods          int
	meanMs, maxMs float64
	lastMs        float64
	slowest       string // the pod with the longest hop
	missing       []string
	lastPod       string // the last pod to pass the step
}

var (
	timelineLineRe = regexp.MustCompile(`"Start timeline" .*\bpod="([^"]+)"`)
	timelineKVRe   = regexp.MustCompile(`\b(\w+)=([0-9.]+)\b`)
	// client-go's response line at V(6): the time, then the PUT of a pod's
	// status with its HTTP status and duration.
	statusPutRe = regexp.MustCompile(`^[IWE](\d{4} \d{2}:\d{2}:\d{2}\.\d{6}) .*"Response" .*\bverb="(?:PATCH|PUT)" url="[^"]*/namespaces/([^/"]+)/pods/([^/"]+)/status[^"]*" status="(\d+)[^"]*" milliseconds=(\d+)`)
)

// parseNodeTimeline reads the agent's log of a burst: the provider's
// start timelines and the status writes (PATCH or PUT), into pods (keyed namespace/name;
// only pods already there are filled). year is the year of the burst
// (klog's header has none); klog writes local time.
func parseNodeTimeline(log string, year int, pods map[string]*burstPod) error {
	type put struct {
		start, end time.Time
		code       int
	}
	puts := map[string][]put{}
	for _, line := range strings.Split(log, "\n") {
		if m := timelineLineRe.FindStringSubmatch(line); m != nil {
			p := pods[m[1]]
			if p == nil {
				continue
			}
			var origin time.Time
			steps := map[string]float64{}
			for _, kv := range timelineKVRe.FindAllStringSubmatch(line, -1) {
				if kv[1] == "createPodUnixMicro" {
					us, err := strconv.ParseInt(kv[2], 10, 64)
					if err != nil {
						return fmt.Errorf("timeline of %s: createPodUnixMicro %q: %w", m[1], kv[2], err)
					}
					origin = time.UnixMicro(us)
					continue
				}
				if name, ok := strings.CutSuffix(kv[1], "Ms"); ok {
					ms, err := strconv.ParseFloat(kv[2], 64)
					if err != nil {
						return fmt.Errorf("timeline of %s: %s=%q: %w", m[1], kv[1], kv[2], err)
					}
					steps[name] = ms
				}
			}
			if origin.IsZero() {
				return fmt.Errorf("timeline of %s without createPodUnixMicro: %s", m[1], line)
			}
			p.at["createPod"] = origin
			for name, ms := range steps {
				p.at[name] = origin.Add(time.Duration(ms * float64(time.Millisecond)))
			}
			continue
		}
		if m := statusPutRe.FindStringSubmatch(line); m != nil {
			end, err := time.ParseInLocation("0102 15:04:05.000000", m[1], time.Local)
			if err != nil {
				return fmt.Errorf("klog time %q: %w", m[1], err)
			}
			end = end.AddDate(year, 0, 0)
			code, _ := strconv.Atoi(m[4])
			ms, _ := strconv.Atoi(m[5])
			key := m[2] + "/" + m[3]
			puts[key] = append(puts[key], put{start: end.Add(-time.Duration(ms) * time.Millisecond), end: end, code: code})
		}
	}
	for key, p := range pods {
		for _, u := range puts[key] {
			if u.code == 409 {
				p.conflicts++
			}
		}
		// The write that carried Ready: the first successful write that began
		// after the provider handed the Ready status over.
		pushed := p.at["pushed"]
		if pushed.IsZero() {
			continue
		}
		for _, u := range puts[key] {
			if u.code/100 == 2 && !u.start.Before(pushed.Truncate(time.Millisecond)) {
				p.at["written"] = u.end
				break
			}
		}
	}
	return nil
}

// burstHops summarizes the pods' timelines step by step from start.
func burstHops(pods map[string]*burstPod, start time.Time) []burstHop {
	return hopsOf(burstSteps, pods, start)
}

// hopsOf summarizes the pods' timelines over steps (in order) from start.
func hopsOf(steps []string, pods map[string]*burstPod, start time.Time) []burstHop {
	names := make([]string, 0, len(pods))
	for n := range pods {
		names = append(names, n)
	}
	sort.Strings(names)
	var hops []burstHop
	for i, step := range steps {
		h := burstHop{step: step}
		var sum float64
		for _, n := range names {
			p := pods[n]
			t := p.at[step]
			if t.IsZero() {
				h.missing = append(h.missing, n)
				continue
			}
			if last := t.Sub(start).Seconds() * 1000; last >= h.lastMs || h.lastPod == "" {
				h.lastMs, h.lastPod = last, n
			}
			// The hop from the latest earlier step this pod reached.
			prev := start
			for j := i - 1; j >= 0; j-- {
				if pt := p.at[steps[j]]; !pt.IsZero() {
					prev = pt
					break
				}
			}
			d := t.Sub(prev).Seconds() * 1000
			sum += d
			h.pods++
			if d > h.maxMs || h.slowest == "" {
				h.maxMs, h.slowest = d, n
			}
		}
		if h.pods > 0 {
			h.meanMs = sum / float64(h.pods)
		}
		hops = append(hops, h)
	}
	return hops
}

// formatHops is the timeline as a table for the benchmark's log.
func formatHops(hops []burstHop) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%-10s %5s %10s %10s %10s  %s\n", "step", "pods", "hop-mean", "hop-max", "last-at", "slowest hop / last pod")
	for _, h := range hops {
		fmt.Fprintf(&b, "%-10s %5d %8.1fms %8.1fms %8.1fms  %s / %s", h.step, h.pods, h.meanMs, h.maxMs, h.lastMs, h.slowest, h.lastPod)
		if len(h.missing) > 0 {
			fmt.Fprintf(&b, "  (missing for %d: %s)", len(h.missing), strings.Join(h.missing[:min(3, len(h.missing))], ", "))
		}
		b.WriteString("\n")
	}
	return b.String()
}

// TestBurstTimeline: the timeline parser reads the provider's line and
// client-go's response lines, picks the status write that came after the
// Ready status was handed over, counts conflicts, and summarizes hops.
func TestBurstTimeline(t *testing.T) {
	start := time.Date(2026, 11, 24, 9, 0, 0, 0, time.Local)
	origin := start.Add(500 * time.Millisecond)
	klogTime := func(d time.Duration) string { return start.Add(d).Format("0102 15:04:05.000000") }
	log := strings.Join([]string{
		fmt.Sprintf(`I%s 42 timeline.go:140] "Start timeline" logger="vms" pod="default/a" uid="u1" createPodUnixMicro=%d admittedMs=0.5 recordedMs=10 workerMs=10.2 imageMs=30 overlayMs=200 qemuExecMs=250 qmpSocketMs=900 qmpMs=1000 startedMs=1000.5 pushedMs=1100 deliveredMs=1100.25`,
			klogTime(1600*time.Millisecond), origin.UnixMicro()),
		// A PUT of an earlier status (began before pushed), a conflict, then the write of Ready (a
		// PATCH, as StatusWriter sends it).
		fmt.Sprintf(`I%s 42 round_trippers.go:632] "Response" verb="PUT" url="https://10.0.0.1:6443/api/v1/namespaces/default/pods/a/status" status="200 OK" milliseconds=20`, klogTime(1610*time.Millisecond)),
		fmt.Sprintf(`I%s 42 round_trippers.go:632] "Response" node="n1" verb="PUT" url="https://10.0.0.1:6443/api/v1/namespaces/default/pods/a/status" status="409 Conflict" milliseconds=3`, klogTime(1700*time.Millisecond)),
		fmt.Sprintf(`I%s 42 round_trippers.go:632] "Response" verb="PATCH" url="https://10.0.0.1:6443/api/v1/namespaces/default/pods/a/status" status="200 OK" milliseconds=5`, klogTime(1900*time.Millisecond)),
		fmt.Sprintf(`I%s 42 round_trippers.go:632] "Response" verb="GET" url="https://10.0.0.1:6443/api/v1/namespaces/default/pods/a" status="200 OK" milliseconds=5`, klogTime(1950*time.Millisecond)),
		// A pod the burst does not know.
		fmt.Sprintf(`I%s 42 timeline.go:140] "Start timeline" logger="vms" pod="default/other" uid="u2" createPodUnixMicro=%d admittedMs=1`, klogTime(time.Second), origin.UnixMicro()),
	}, "\n")
	pods := map[string]*burstPod{
		"default/a": {at: map[string]time.Time{"created": start.Add(50 * time.Millisecond), "bound": start.Add(300 * time.Millisecond), "ready": start.Add(2 * time.Second)}},
		"default/b": {at: map[string]time.Time{"created": start.Add(60 * time.Millisecond)}},
	}
	if err := parseNodeTimeline(log, start.Year(), pods); err != nil {
		t.Fatal(err)
	}
	a := pods["default/a"]
	if got, want := a.at["qmp"], origin.Add(time.Second); !got.Equal(want) {
		t.Errorf("qmp at %v, want %v", got, want)
	}
	if got, want := a.at["written"], start.Add(1900*time.Millisecond); !got.Equal(want) {
		t.Errorf("written at %v, want %v (the first 2xx write begun after pushed)", got, want)
	}
	if a.conflicts != 1 {
		t.Errorf("conflicts = %d, want 1", a.conflicts)
	}
	hops := burstHops(pods, start)
	if len(hops) != len(burstSteps) {
		t.Fatalf("%d hops for %d steps", len(hops), len(burstSteps))
	}
	byStep := map[string]burstHop{}
	for _, h := range hops {
		byStep[h.step] = h
	}
	// created: both pods, from start; b's is the last.
	if h := byStep["created"]; h.pods != 2 || h.meanMs != 55 || h.lastPod != "default/b" || math.Abs(h.lastMs-60) > 1e-9 {
		t.Errorf("created hop: %+v", h)
	}
	// qemuExec -> qmpSocket for a: 650 ms; b is missing.
	if h := byStep["qmpSocket"]; h.pods != 1 || math.Abs(h.meanMs-650) > 1e-6 || len(h.missing) != 1 {
		t.Errorf("qmpSocket hop: %+v", h)
	}
	// bound -> createPod: 200 ms.
	if h := byStep["createPod"]; math.Abs(h.maxMs-200) > 1e-6 {
		t.Errorf("createPod hop: %+v", h)
	}
	// written -> ready: 100 ms, last at 2000 ms.
	if h := byStep["ready"]; math.Abs(h.meanMs-100) > 1e-6 || math.Abs(h.lastMs-2000) > 1e-6 {
		t.Errorf("ready hop: %+v", h)
	}
	if s := formatHops(hops); !strings.Contains(s, "qmpSocket") || !strings.Contains(s, "missing for 1") {
		t.Errorf("table:\n%s", s)
	}
}

// TestBurstStepsMatchProvider: the timeline's node steps are the ones the
// provider logs, in its order.
func TestBurstStepsMatchProvider(t *testing.T) {
	var node []string
	for s := telemetry.StepCreatePod; s.String() != "step"+strconv.Itoa(int(s)); s++ {
		node = append(node, s.String())
	}
	from := slices.Index(burstSteps, telemetry.StepCreatePod.String())
	if from < 0 || from+len(node) > len(burstSteps) || !slices.Equal(burstSteps[from:from+len(node)], node) {
		t.Errorf("burstSteps %v do not hold the provider's steps %v in order", burstSteps, node)
	}
}
