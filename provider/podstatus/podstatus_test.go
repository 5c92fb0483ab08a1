package podstatus

import (
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/provider/internal/podtest"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func TestBackoff(t *testing.T) {
	b := DefaultBackoff
	want := []time.Duration{0, 10 * time.Second, 20 * time.Second, 40 * time.Second, 80 * time.Second, 160 * time.Second, 5 * time.Minute, 5 * time.Minute}
	for n, w := range want {
		assert.Equal(t, w, b.Delay(n), "Delay(%d)", n)
	}
	restart := []time.Duration{0, 0, 10 * time.Second, 20 * time.Second, 40 * time.Second}
	for n, w := range restart {
		assert.Equal(t, w, b.RestartDelay(n), "RestartDelay(%d)", n)
	}
	assert.Equal(t, 5*time.Minute, b.Delay(100))
}

func TestRestartDecision(t *testing.T) {
	cases := []struct {
		policy corev1.RestartPolicy
		code   int32
		want   bool
	}{
		{corev1.RestartPolicyAlways, 0, true}, {corev1.RestartPolicyAlways, 137, true}, {"", 0, true},
		{corev1.RestartPolicyOnFailure, 0, false}, {corev1.RestartPolicyOnFailure, 139, true},
		{corev1.RestartPolicyNever, 0, false}, {corev1.RestartPolicyNever, 134, false},
	}
	for _, tc := range cases {
		assert.Equal(t, tc.want, RestartDecision(tc.policy, tc.code), "%s/%d", tc.policy, tc.code)
	}
}

func TestTerminatedFromExit(t *testing.T) {
	at := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	cases := []struct {
		ex     qemu.Exit
		reason string
	}{
		{qemu.Exit{Class: qemu.ExitGuestShutdown, ExitCode: 0, Reason: "guest powered off", At: at}, ReasonCompleted},
		{qemu.Exit{Class: qemu.ExitPanicked, ExitCode: qemu.ExitCodePanicked, Reason: "guest kernel panicked (pvpanic)", At: at}, ReasonGuestPanicked},
		{qemu.Exit{Class: qemu.ExitCrashed, ExitCode: qemu.ExitCodeCrashed, Reason: "QEMU exited unexpectedly", At: at}, ReasonError},
		{qemu.Exit{Class: qemu.ExitKilled, ExitCode: qemu.ExitCodeKilled, Reason: "quit", At: at}, ReasonError},
	}
	for _, tc := range cases {
		got := TerminatedFromExit(tc.ex, at.Add(-time.Minute), "qemu://u")
		assert.Equal(t, tc.reason, got.Reason)
		assert.Equal(t, int32(tc.ex.ExitCode), got.ExitCode)
		assert.Equal(t, tc.ex.Reason, got.Message)
		assert.Equal(t, at, got.FinishedAt.Time.UTC())
		assert.Equal(t, "qemu://u", got.ContainerID)
	}
}

func TestPodStatusPhases(t *testing.T) {
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	pod := podtest.VMPod()
	pod.Status.QOSClass = corev1.PodQOSBestEffort
	term := func(code int32) *corev1.ContainerStateTerminated {
		return &corev1.ContainerStateTerminated{ExitCode: code, Reason: "x"}
	}
	cases := []struct {
		name  string
		st    VMState
		phase corev1.PodPhase
		ready bool
		wait  string
	}{
		{"creating", VMState{StartTime: now}, corev1.PodPending, false, ReasonContainerCreating},
		{"pull backoff", func() VMState { s := VMState{StartTime: now}; s.SetWaiting(ReasonImagePullBackOff, "m"); return s }(), corev1.PodPending, false, ReasonImagePullBackOff},
		{"running", func() VMState { s := VMState{StartTime: now}; s.SetRunning(now); return s }(), corev1.PodRunning, true, ""},
		{"crash loop", func() VMState {
			s := VMState{StartTime: now, RestartCount: 2, LastTerminated: term(139), Started: true}
			s.SetWaiting(ReasonCrashLoopBackOff, "m")
			return s
		}(), corev1.PodRunning, false, ReasonCrashLoopBackOff},
		{"succeeded", VMState{StartTime: now, Terminated: term(0), Final: true, Started: true}, corev1.PodSucceeded, false, ""},
		{"failed", VMState{StartTime: now, Terminated: term(134), Final: true, Started: true}, corev1.PodFailed, false, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := PodStatus(pod, tc.st, "10.0.0.5", now)
			assert.Equal(t, tc.phase, s.Phase)
			assert.Equal(t, corev1.PodQOSBestEffort, s.QOSClass)
			assert.Equal(t, "10.0.0.5", s.PodIP)
			require.Len(t, s.ContainerStatuses, 1)
			cs := s.ContainerStatuses[0]
			assert.Equal(t, "vm", cs.Name)
			assert.Equal(t, tc.ready, cs.Ready)
			assert.Equal(t, tc.st.RestartCount, cs.RestartCount)
			if tc.wait != "" {
				require.NotNil(t, cs.State.Waiting)
				assert.Equal(t, tc.wait, cs.State.Waiting.Reason)
			}
			for _, c := range s.Conditions {
				if c.Type == corev1.PodReady {
					assert.Equal(t, tc.ready, c.Status == corev1.ConditionTrue)
				}
			}
		})
	}
	rej := PodStatus(pod, VMState{StartTime: now, Rejection: &podspec.Rejection{Reason: "OutOfcpu", Message: "m"}, Final: true}, "", now)
	assert.Equal(t, corev1.PodFailed, rej.Phase)
	assert.Equal(t, "OutOfcpu", rej.Reason)
	require.NotNil(t, rej.ContainerStatuses[0].State.Terminated)
	assert.Equal(t, "OutOfcpu", rej.ContainerStatuses[0].State.Terminated.Reason)
}

func TestDeleteGrace(t *testing.T) {
	secs := func(n int64) *int64 { return &n }
	past := metav1.NewTime(time.Now().Add(-time.Minute))
	future := metav1.NewTime(time.Now().Add(5 * time.Second))
	for _, c := range []struct {
		name string
		meta metav1.ObjectMeta
		spec *int64
		want time.Duration
	}{
		{"the deletion's period, whatever is left of it", metav1.ObjectMeta{DeletionTimestamp: &future, DeletionGracePeriodSeconds: secs(10)}, secs(30), 10 * time.Second},
		{"a node acting after the deadline (host back, agent restarted) still gives the period", metav1.ObjectMeta{DeletionTimestamp: &past, DeletionGracePeriodSeconds: secs(10)}, secs(30), 10 * time.Second},
		{"a zero period (a forced deletion seen as an update)", metav1.ObjectMeta{DeletionTimestamp: &past, DeletionGracePeriodSeconds: secs(0)}, secs(30), 0},
		{"no deletion period: the spec's", metav1.ObjectMeta{}, secs(20), 20 * time.Second},
		{"neither: the node's default", metav1.ObjectMeta{}, nil, 45 * time.Second},
	} {
		pod := &corev1.Pod{ObjectMeta: c.meta, Spec: corev1.PodSpec{TerminationGracePeriodSeconds: c.spec}}
		assert.Equal(t, c.want, DeleteGrace(pod, 45*time.Second), c.name)
	}
}

func TestACPIBudget(t *testing.T) {
	for grace, want := range map[time.Duration]time.Duration{
		30 * time.Second: 27 * time.Second, 10 * time.Second: 7 * time.Second, 100 * time.Second: 95 * time.Second,
		// QEMU's QuitGrace and a second for the status fit before the deadline.
		6 * time.Second: 3 * time.Second,
		2 * time.Second: time.Second, 0: time.Second, -5 * time.Second: time.Second,
	} {
		assert.Equal(t, want, ACPIBudget(grace), "grace %s", grace)
	}
}
