package controller

import (
	"testing"

	"github.com/stretchr/testify/assert"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	jsv1 "github.com/qemu-kubelet/qemu-kubelet/api/jumpstarter/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	vtv1 "github.com/qemu-kubelet/qemu-kubelet/api/virtualtarget/v1alpha1"
)

func phases(ps ...corev1.PodPhase) []corev1.Pod {
	out := make([]corev1.Pod, len(ps))
	for i, p := range ps {
		out[i].Status.Phase = p
	}
	return out
}

// TestUpstreamStatus: the planner's status in upstream's fields: counts,
// pod phases, the four conditions with upstream's reasons for the steady
// states (the planner's for work in progress); ScalingLimited when
// maxReplicas caps what the spec and the leases want; a failure keeps the
// counts.
func TestUpstreamStatus(t *testing.T) {
	prev := vtv1.ExporterSetStatus{Replicas: 7, ReadyReplicas: 5, Selector: "old"}
	for _, tc := range []struct {
		name  string
		in    upstreamStatusInput
		check func(t *testing.T, st vtv1.ExporterSetStatus, c upstreamConditions)
	}{
		{name: "counts and phases",
			in: upstreamStatusInput{Plan: &Status{Replicas: 4, Ready: 3, Available: 1, Leased: 2, Conditions: []Condition{
				{v1alpha1.ConditionAvailable, metav1.ConditionTrue, "MinimumReplicasAvailable", "m"},
				{v1alpha1.ConditionProgressing, metav1.ConditionFalse, "Complete", "p"}}},
				Pods: phases(corev1.PodPending, corev1.PodRunning, corev1.PodRunning, corev1.PodFailed, corev1.PodSucceeded, ""), Selector: "s"},
			check: func(t *testing.T, st vtv1.ExporterSetStatus, c upstreamConditions) {
				assert.Equal(t, vtv1.ExporterSetStatus{Replicas: 4, ReadyReplicas: 3, AvailableReplicas: 1, UnavailableReplicas: 1, LeasedReplicas: 2,
					PodsPending: 2, PodsRunning: 2, PodsFailed: 1, PodsUnknown: 1, ExportersOffline: 6, Selector: "s"}, st)
				assert.Equal(t, upstreamConditions{
					{vtv1.ExporterSetConditionAvailable, metav1.ConditionTrue, "MinimumReplicasAvailable", "m"},
					{vtv1.ExporterSetConditionProgressing, metav1.ConditionFalse, "AllReplicasReady", "p"},
					{vtv1.ExporterSetConditionDegraded, metav1.ConditionFalse, "AllReplicasHealthy", "no instance fails"},
					{vtv1.ExporterSetConditionScalingLimited, metav1.ConditionFalse, "WithinLimits", "maxReplicas holds nothing back"},
				}, c)
			}},
		{name: "minReplicas 0 and no instance: NoReplicasRequired",
			in: upstreamStatusInput{Plan: &Status{Conditions: []Condition{
				{v1alpha1.ConditionAvailable, metav1.ConditionTrue, "MinimumReplicasAvailable", "0/0 pods ready"}}}},
			check: func(t *testing.T, _ vtv1.ExporterSetStatus, c upstreamConditions) {
				assert.Equal(t, Condition{vtv1.ExporterSetConditionAvailable, metav1.ConditionTrue, "NoReplicasRequired", "0/0 pods ready"}, c[0])
			}},
		{name: "minReplicas 0 with a leased instance: MinimumReplicasAvailable",
			in: upstreamStatusInput{Plan: &Status{Replicas: 1, Ready: 1, Leased: 1, Conditions: []Condition{
				{v1alpha1.ConditionAvailable, metav1.ConditionTrue, "MinimumReplicasAvailable", "m"}}}},
			check: func(t *testing.T, _ vtv1.ExporterSetStatus, c upstreamConditions) {
				assert.Equal(t, "MinimumReplicasAvailable", c[0].Reason)
			}},
		{name: "minReplicas 0, minAvailableReplicas 1 not yet met: the planner's Unavailable",
			in: upstreamStatusInput{Knobs: Input{MinAvailable: 1}, Plan: &Status{Conditions: []Condition{
				{v1alpha1.ConditionAvailable, metav1.ConditionFalse, "MinimumReplicasUnavailable", "0/1 pods ready"}}}},
			check: func(t *testing.T, _ vtv1.ExporterSetStatus, c upstreamConditions) {
				assert.Equal(t, Condition{vtv1.ExporterSetConditionAvailable, metav1.ConditionFalse, "MinimumReplicasUnavailable", "0/1 pods ready"}, c[0])
			}},
		{name: "work in progress keeps the planner's reasons",
			in: upstreamStatusInput{Plan: &Status{Replicas: 3, Conditions: []Condition{
				{v1alpha1.ConditionProgressing, metav1.ConditionTrue, "ScalingDown", "deleting 1 pods towards 2"}}}},
			check: func(t *testing.T, _ vtv1.ExporterSetStatus, c upstreamConditions) {
				assert.Equal(t, Condition{vtv1.ExporterSetConditionProgressing, metav1.ConditionTrue, "ScalingDown", "deleting 1 pods towards 2"}, c[1])
			}},
		{name: "Progressing False for another cause keeps its reason",
			in: upstreamStatusInput{Plan: &Status{Conditions: []Condition{
				{v1alpha1.ConditionProgressing, metav1.ConditionFalse, "RemovalWaitsForRelease", "r"}}}},
			check: func(t *testing.T, _ vtv1.ExporterSetStatus, c upstreamConditions) {
				assert.Equal(t, "RemovalWaitsForRelease", c[1].Reason)
			}},
		{name: "ReplicaFailure is Degraded",
			in: upstreamStatusInput{Plan: &Status{Conditions: []Condition{{v1alpha1.ConditionReplicaFailure, metav1.ConditionTrue, "FailedCreate", "quota"}}}},
			check: func(t *testing.T, _ vtv1.ExporterSetStatus, c upstreamConditions) {
				assert.Equal(t, Condition{vtv1.ExporterSetConditionDegraded, metav1.ConditionTrue, "FailedCreate", "quota"}, c[2])
				assert.Equal(t, metav1.ConditionUnknown, c[0].Status, "no Available condition planned")
			}},
		{name: "leases and pending leases over maxReplicas",
			in: upstreamStatusInput{Plan: &Status{Leased: 2, PendingLeases: 2}, Knobs: Input{Replicas: 1, MinAvailable: 1, MaxReplicas: ptr.To[int32](4)}},
			check: func(t *testing.T, _ vtv1.ExporterSetStatus, c upstreamConditions) {
				assert.Equal(t, metav1.ConditionTrue, c[3].Status)
				assert.Equal(t, "AtMaxReplicas", c[3].Reason)
				assert.Contains(t, c[3].Message, "5 instances wanted")
			}},
		{name: "no limit never limits",
			in: upstreamStatusInput{Plan: &Status{Leased: 50}, Knobs: Input{MinAvailable: 1}},
			check: func(t *testing.T, _ vtv1.ExporterSetStatus, c upstreamConditions) {
				assert.Equal(t, metav1.ConditionFalse, c[3].Status)
			}},
		{name: "failure keeps the counts",
			in: upstreamStatusInput{Failure: &ClassError{ReasonInvalidParameters, "bad size"}},
			check: func(t *testing.T, st vtv1.ExporterSetStatus, c upstreamConditions) {
				assert.Equal(t, vtv1.ExporterSetStatus{Replicas: 7, ReadyReplicas: 5, Selector: "old"}, st)
				assert.Equal(t, Condition{vtv1.ExporterSetConditionDegraded, metav1.ConditionTrue, ReasonInvalidParameters, "bad size"}, c[2])
				assert.Equal(t, metav1.ConditionFalse, c[0].Status)
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st, c := upstreamStatus(prev, tc.in)
			tc.check(t, st, c)
		})
	}
}

// TestExporterCounts: upstream's exporter counts from the pods' Exporters:
// leased is active, disabled is disabled, Online enabled unleased is idle,
// the rest (no Exporter yet, not Online) offline.
func TestExporterCounts(t *testing.T) {
	pods := make([]corev1.Pod, 6)
	for i, n := range []string{"leased", "disabled", "idle", "offline", "none", "leased-disabled"} {
		pods[i].Name = n
	}
	online := []metav1.Condition{{Type: jsv1.ExporterConditionOnline, Status: metav1.ConditionTrue}}
	exps := map[string]*jsv1.Exporter{
		"leased":          {Status: jsv1.ExporterStatus{LeaseRef: &corev1.LocalObjectReference{Name: "l"}, Conditions: online}},
		"disabled":        {Spec: jsv1.ExporterSpec{Enabled: ptr.To(false)}, Status: jsv1.ExporterStatus{Conditions: online}},
		"idle":            {Spec: jsv1.ExporterSpec{Enabled: ptr.To(true)}, Status: jsv1.ExporterStatus{Conditions: online}},
		"offline":         {Spec: jsv1.ExporterSpec{Enabled: ptr.To(true)}},
		"leased-disabled": {Spec: jsv1.ExporterSpec{Enabled: ptr.To(false)}, Status: jsv1.ExporterStatus{LeaseRef: &corev1.LocalObjectReference{Name: "m"}}},
	}
	active, idle, disabled, offline := exporterCounts(pods, exps)
	assert.Equal(t, []int32{2, 1, 1, 2}, []int32{active, idle, disabled, offline}, "active, idle, disabled, offline")
}

func TestUpstreamSelector(t *testing.T) {
	set := func(sel metav1.LabelSelector) *vtv1.ExporterSet {
		return &vtv1.ExporterSet{Spec: vtv1.ExporterSetSpec{Selector: sel}}
	}
	assert.Equal(t, "board=rpi4,virtual=true", upstreamSelector(set(metav1.LabelSelector{MatchLabels: map[string]string{"virtual": "true", "board": "rpi4"}})),
		"spec.selector serialized")
	assert.Equal(t, "board in (rpi4,rpi5)", upstreamSelector(set(metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{
		{Key: "board", Operator: metav1.LabelSelectorOpIn, Values: []string{"rpi5", "rpi4"}}}})))
	assert.Empty(t, upstreamSelector(set(metav1.LabelSelector{})), "empty: not written")
	assert.Empty(t, upstreamSelector(set(metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{
		{Key: "board", Operator: "Near"}}})), "invalid: not written")
}

func TestNewUpstreamPodLabels(t *testing.T) {
	set := &vtv1.ExporterSet{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "rpi"}, Spec: vtv1.ExporterSetSpec{
		Template: vtv1.ExporterSetTemplate{Metadata: vtv1.TemplateMetadata{Labels: map[string]string{"board": "rpi4", UpstreamLabel: "other", UpstreamExporterSetLabel: "other",
			v1alpha1.LeaseLabel: "x", v1alpha1.UsedLabel: "true"}}}}}
	tmpl := &corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{UpstreamLabel: "rpi"}}}
	p := newUpstreamPod(set, tmpl, "h1")
	assert.Equal(t, map[string]string{"board": "rpi4", UpstreamLabel: "rpi", UpstreamExporterSetLabel: "rpi", v1alpha1.TemplateHashLabel: "h1"}, p.Labels,
		"the template's labels (spec.selector selects the pods), this controller's own winning, never the lease or used mark")
}
