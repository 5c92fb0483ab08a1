package controller

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func TestFinishPods(t *testing.T) {
	heal := &Autohealing{StartUpFailureThreshold: 3, MinFailingToStartDuration: 5 * time.Minute}
	crashing := func(restarts int32, notReadyFor time.Duration) func(*PodState) {
		return func(p *PodState) {
			waiting("CrashLoopBackOff")(p)
			p.RestartCount, p.NotReadySince = restarts, t0.Add(-notReadyFor)
		}
	}
	succeeded := func(p *PodState) { p.Phase, p.Ready = corev1.PodSucceeded, false }
	cases := []struct {
		name            string
		pods            []PodState
		removed         map[string]bool
		heal            *Autohealing
		wantDelete      []string
		wantLive        []string
		wantNewFailures int32
		wantLastFailed  string // name; "" for none
		wantLastReason  string
		wantRequeue     time.Duration
	}{
		{name: "running pods are live", pods: []PodState{pod("a", time.Minute), pod("b", time.Minute, notReady)},
			wantLive: []string{"a", "b"}},
		{name: "failed pod goes and counts", pods: []PodState{pod("a", time.Minute, failed("OOMKilled"))},
			wantDelete: []string{"a:" + ReasonFailed}, wantNewFailures: 1, wantLastFailed: "a", wantLastReason: "OOMKilled"},
		{name: "failed pod whose Exporter drains was counted when disabled", pods: []PodState{pod("a", time.Minute, failed("OOMKilled"),
			func(p *PodState) { p.Exporter = ExporterState{Found: true, DisabledAt: t0.Add(-time.Second)} })},
			wantDelete: []string{"a:" + ReasonFailed}},
		{name: "failed pod with an enabled Exporter counts", pods: []PodState{pod("a", time.Minute, failed("OOMKilled"),
			func(p *PodState) { p.Exporter = ExporterState{Found: true, Enabled: true} })},
			wantDelete: []string{"a:" + ReasonFailed}, wantNewFailures: 1, wantLastFailed: "a", wantLastReason: "OOMKilled"},
		{name: "autohealed pod whose Exporter drains was counted when disabled",
			pods: []PodState{pod("a", time.Hour, crashing(3, 5*time.Minute), func(p *PodState) { p.Exporter = ExporterState{Found: true, DisabledAt: t0} })},
			heal: heal, wantDelete: []string{"a:" + ReasonFailingToStart}},
		{name: "succeeded pod goes without counting", pods: []PodState{pod("a", time.Minute, succeeded)},
			wantDelete: []string{"a:" + ReasonFailed}},
		{name: "leased failed pod stays for its holder, not live",
			pods: []PodState{pod("a", time.Minute, failed("E"), leased)}},
		{name: "terminating and removed pods are neither live nor deleted",
			pods:    []PodState{pod("a", time.Minute, term), pod("b", time.Minute)},
			removed: map[string]bool{"b": true}},
		{name: "autohealing replaces a pod failing to start long enough",
			pods: []PodState{pod("a", time.Hour, crashing(3, 5*time.Minute))}, heal: heal,
			wantDelete: []string{"a:" + ReasonFailingToStart}, wantNewFailures: 1, wantLastFailed: "a", wantLastReason: "CrashLoopBackOff"},
		{name: "autohealing waits for the minimum duration; requeue then",
			pods: []PodState{pod("a", time.Hour, crashing(3, 4*time.Minute))}, heal: heal,
			wantLive: []string{"a"}, wantRequeue: time.Minute},
		{name: "autohealing waits for the restart threshold",
			pods: []PodState{pod("a", time.Hour, crashing(2, time.Hour))}, heal: heal, wantLive: []string{"a"}},
		{name: "image pull errors are no reason to heal",
			pods: []PodState{pod("a", time.Hour, waiting("ErrImagePull"), func(p *PodState) { p.RestartCount = 9 })}, heal: heal,
			wantLive: []string{"a"}},
		{name: "without autohealing a crash-looping pod stays",
			pods: []PodState{pod("a", time.Hour, crashing(9, time.Hour))}, wantLive: []string{"a"}},
		{name: "leased crash-looping pod is never healed",
			pods: []PodState{pod("a", time.Hour, crashing(9, time.Hour), leased)}, heal: heal, wantLive: []string{"a"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			out := finishPods(finishInput{Pods: tc.pods, Removed: tc.removed, Autohealing: tc.heal, Now: t0})
			assert.Equal(t, tc.wantDelete, deletions(Actions{Delete: out.Delete}), "delete")
			assert.Equal(t, tc.wantLive, names(out.Live), "live")
			assert.Equal(t, tc.wantNewFailures, out.NewFailures, "new failures")
			assert.Equal(t, tc.wantRequeue, out.Requeue, "requeue")
			if tc.wantLastFailed == "" {
				assert.Nil(t, out.LastFailed)
				return
			}
			if assert.NotNil(t, out.LastFailed) {
				assert.Equal(t, tc.wantLastFailed, out.LastFailed.Name)
				assert.Equal(t, tc.wantLastReason, out.LastFailed.FailedReason)
			}
		})
	}
}

func TestBackoff(t *testing.T) {
	at := func(d time.Duration) *time.Time { x := t0.Add(d); return &x }
	freshReady := func(since time.Duration) func(*PodState) {
		return func(p *PodState) { p.ReadySince = t0.Add(-since) }
	}
	cases := []struct {
		name         string
		in           backoffInput
		wantFailures int32
		wantLast     *time.Time
		wantWait     time.Duration
		wantRequeue  time.Duration
	}{
		{name: "no failures, no wait", in: backoffInput{}},
		{name: "first failure: counted, no wait",
			in: backoffInput{NewFailures: 1}, wantFailures: 1, wantLast: at(0)},
		{name: "second failure: base wait",
			in: backoffInput{Failures: 1, LastFailure: at(-time.Hour), NewFailures: 1}, wantFailures: 2, wantLast: at(0),
			wantWait: failureBackoffBase},
		{name: "wait doubles per failure",
			in:           backoffInput{Failures: 3, LastFailure: at(-5 * time.Second)},
			wantFailures: 3, wantLast: at(-5 * time.Second), wantWait: 2*failureBackoffBase - 5*time.Second},
		{name: "wait capped at the maximum",
			in:           backoffInput{Failures: 40, LastFailure: at(0)},
			wantFailures: 40, wantLast: at(0), wantWait: failureBackoffMax},
		{name: "paused: new failures wait to be counted",
			in:           backoffInput{Failures: 1, LastFailure: at(-time.Hour), NewFailures: 2, Paused: true},
			wantFailures: 1, wantLast: at(-time.Hour)},
		{name: "pod created after the failure and stably Ready resets the count",
			in: backoffInput{Failures: 4, LastFailure: at(-time.Hour),
				Live: []PodState{pod("a", time.Minute, freshReady(2*stableReady))}},
			wantFailures: 0, wantLast: at(-time.Hour)},
		{name: "pod Ready only briefly: no reset yet, requeue when it may count",
			in: backoffInput{Failures: 2, LastFailure: at(-time.Hour),
				Live: []PodState{pod("a", time.Minute, freshReady(10*time.Second))}},
			wantFailures: 2, wantLast: at(-time.Hour), wantRequeue: stableReady - 10*time.Second,
			wantWait: failureBackoffBase - time.Hour},
		{name: "pod older than the failure does not reset",
			in: backoffInput{Failures: 2, LastFailure: at(-time.Hour),
				Live: []PodState{pod("a", 2*time.Hour)}},
			wantFailures: 2, wantLast: at(-time.Hour), wantWait: failureBackoffBase - time.Hour},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tc.in.Now = t0
			out := backoff(tc.in)
			assert.Equal(t, tc.wantFailures, out.Failures, "failures")
			assert.Equal(t, tc.wantLast, out.LastFailure, "last failure")
			assert.Equal(t, tc.wantWait, out.Wait, "wait")
			assert.Equal(t, tc.wantRequeue, out.Requeue, "requeue")
		})
	}
}

func TestReplicaFailure(t *testing.T) {
	lastFailed := pod("f", time.Minute, failed("OOMKilled"))
	cases := []struct {
		name        string
		in          replicaFailureInput
		wantStatus  metav1.ConditionStatus
		wantReason  string
		wantMessage string
	}{
		{name: "no failures", in: replicaFailureInput{Live: []PodState{pod("a", time.Minute)}},
			wantStatus: metav1.ConditionFalse, wantReason: "NoFailures", wantMessage: "pods start"},
		{name: "stuck pods name the first by name",
			in: replicaFailureInput{Live: []PodState{pod("b", time.Minute, waiting("ErrImagePull")),
				pod("a", time.Minute, waiting("ImagePullBackOff"))}, Failures: 5},
			wantStatus: metav1.ConditionTrue, wantReason: "ImagePullBackOff",
			wantMessage: "2 pods cannot start; pod a: pull oci://x: not found"},
		{name: "failures below the threshold are no condition",
			in:         replicaFailureInput{Failures: failureThreshold - 1, LastFailed: &lastFailed},
			wantStatus: metav1.ConditionFalse, wantReason: "NoFailures", wantMessage: "pods start"},
		{name: "repeated failures name the last failed pod",
			in:         replicaFailureInput{Failures: failureThreshold, LastFailed: &lastFailed},
			wantStatus: metav1.ConditionTrue, wantReason: "OOMKilled",
			wantMessage: "3 pods failed in a row; last: pod f: qemu exited 1"},
		{name: "repeated failures keep the previous detail when no pod failed now",
			in: replicaFailureInput{Failures: 4, Prev: &Condition{"ReplicaFailure", metav1.ConditionTrue, "Crash",
				"3 pods failed in a row; last: pod q: boom"}},
			wantStatus: metav1.ConditionTrue, wantReason: "Crash",
			wantMessage: "4 pods failed in a row; last: pod q: boom"},
		{name: "repeated failures without any detail",
			in:         replicaFailureInput{Failures: 4, Prev: &Condition{"ReplicaFailure", metav1.ConditionTrue, "X", "other"}},
			wantStatus: metav1.ConditionTrue, wantReason: "PodFailed", wantMessage: "4 pods failed in a row"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := replicaFailure(tc.in)
			assert.Equal(t, "ReplicaFailure", c.Type)
			assert.Equal(t, tc.wantStatus, c.Status)
			assert.Equal(t, tc.wantReason, c.Reason)
			assert.Equal(t, tc.wantMessage, c.Message)
		})
	}
}
