package telemetry

import (
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

// TestStartTimeline: a pod's timeline begins at CreatePod, collects its
// steps, and is logged once, when the first Ready status has been handed
// to the library; statuses before Ready, unknown pods and a nil Telemetry
// log nothing; a timeline whose pod never turned Ready is dropped after
// timelineMaxAge.
func TestStartTimeline(t *testing.T) {
	var lines []string
	log := funcr.New(func(prefix, args string) { lines = append(lines, args) }, funcr.Options{Verbosity: 2})
	tel := NewTelemetry(nil, nil)
	t0 := time.Date(2026, 11, 24, 9, 0, 0, 0, time.UTC)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	pod := func(uid types.UID, ready bool) *corev1.Pod {
		st := corev1.ConditionFalse
		if ready {
			st = corev1.ConditionTrue
		}
		return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "p-" + string(uid), UID: uid},
			Status: corev1.PodStatus{Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: st}}}}
	}

	tel.BeginTimeline("a", t0)
	tel.Mark("a", StepAdmitted, at(1))
	tel.Mark("a", StepRecorded, at(20))
	tel.Mark("a", StepImage, at(25))
	tel.Mark("a", StepImage, at(30)) // a retried step: the last time counts
	tel.Mark("a", StepQMP, at(900))
	tel.Mark("a", StepOverlay, time.Time{}) // not reached: ignored
	tel.Mark("unknown", StepAdmitted, at(1))
	tel.StatusDelivered(log, pod("a", false), at(950), at(951))
	if len(lines) != 0 {
		t.Fatalf("logged before Ready: %q", lines)
	}
	tel.StatusDelivered(log, pod("a", true), at(1000), at(1002))
	tel.StatusDelivered(log, pod("a", true), at(2000), at(2001)) // once only
	if len(lines) != 1 {
		t.Fatalf("logged %d lines, want 1: %q", len(lines), lines)
	}
	for _, want := range []string{
		`"msg"="Start timeline"`, `"uid"="a"`, `"createPodUnixMicro"=` + strconv.FormatInt(t0.UnixMicro(), 10),
		`"admittedMs"=1`, `"recordedMs"=20`, `"imageMs"=30`, `"qmpMs"=900`, `"pushedMs"=1000`, `"deliveredMs"=1002`,
	} {
		if !strings.Contains(lines[0], want) {
			t.Errorf("timeline %s lacks %s", lines[0], want)
		}
	}
	if strings.Contains(lines[0], "overlayMs") {
		t.Errorf("timeline %s names a step not reached", lines[0])
	}
	tel.StatusDelivered(log, pod("unknown", true), at(1), at(2))
	if len(lines) != 1 {
		t.Errorf("a pod without a timeline logged: %q", lines[1:])
	}

	// A pod that never turns Ready is dropped by a later CreatePod.
	tel.BeginTimeline("stuck", t0)
	tel.BeginTimeline("late", t0.Add(timelineMaxAge+time.Second))
	tel.mu.Lock()
	_, kept := tel.timelines["stuck"]
	n := len(tel.timelines)
	tel.mu.Unlock()
	if kept || n != 1 {
		t.Errorf("after %v: stuck kept=%v, %d timelines; want dropped, 1", timelineMaxAge, kept, n)
	}

	var none *Telemetry // VMsConfig.Telemetry is optional
	none.BeginTimeline("a", t0)
	none.Mark("a", StepAdmitted, t0)
	none.markQEMU("a", nil)
	none.StatusDelivered(log, pod("a", true), t0, t0)
	if len(lines) != 1 {
		t.Errorf("a nil Telemetry logged: %q", lines[1:])
	}
}
