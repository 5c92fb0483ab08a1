package controller

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func TestAvailableCondition(t *testing.T) {
	cases := []struct {
		name       string
		in         availableInput
		wantStatus metav1.ConditionStatus
		wantReason string
	}{
		{name: "all ready and enough available", in: availableInput{Ready: 3, Target: 3, Available: 2, WantAvailable: 2},
			wantStatus: metav1.ConditionTrue, wantReason: "MinimumReplicasAvailable"},
		{name: "too few ready", in: availableInput{Ready: 2, Target: 3, Available: 2, WantAvailable: 2},
			wantStatus: metav1.ConditionFalse, wantReason: "MinimumReplicasUnavailable"},
		{name: "too few available", in: availableInput{Ready: 3, Target: 3, Available: 1, WantAvailable: 2},
			wantStatus: metav1.ConditionFalse, wantReason: "MinimumReplicasUnavailable"},
		{name: "empty set wanting nothing", in: availableInput{},
			wantStatus: metav1.ConditionTrue, wantReason: "MinimumReplicasAvailable"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := availableCondition(tc.in)
			assert.Equal(t, tc.wantStatus, c.Status)
			assert.Equal(t, tc.wantReason, c.Reason)
			assert.Contains(t, c.Message, "pods ready")
		})
	}
}

func TestProgressing(t *testing.T) {
	cases := []struct {
		name        string
		in          progressInput
		wantStatus  metav1.ConditionStatus
		wantReason  string
		wantMessage string
	}{
		{name: "paused says what it would do",
			in:         progressInput{Paused: true, Would: pausedWork{Create: 2, Delete: 1, Exporters: 3, Removals: 1}, Create: 2},
			wantStatus: metav1.ConditionUnknown, wantReason: "Paused",
			wantMessage: "spec.paused: scaling stopped; would create 2 and delete 1 pods and change 3 exporters; 1 pods marked qemu-kubelet.io/remove=true wait"},
		{name: "removing before anything else",
			in:         progressInput{Removals: 1, Replicas: 2, Create: 1, BackingOff: true},
			wantStatus: metav1.ConditionTrue, wantReason: "Removing",
			wantMessage: "removing 1 pods marked qemu-kubelet.io/remove=true; spec.replicas 2"},
		{name: "backoff before creates",
			in:         progressInput{BackingOff: true, Failures: 3, BackoffWait: 19600 * time.Millisecond, PendingCreates: 1},
			wantStatus: metav1.ConditionTrue, wantReason: "FailureBackoff", wantMessage: "3 pods failed in a row; next create in 20s"},
		{name: "creates in flight are scaling up",
			in:         progressInput{PendingCreates: 2, Target: 4},
			wantStatus: metav1.ConditionTrue, wantReason: "ScalingUp", wantMessage: "creating 0 pods (2 in flight) towards 4"},
		{name: "draining exporters",
			in:         progressInput{Draining: 2, DrainDelay: time.Minute, Retiring: 1},
			wantStatus: metav1.ConditionTrue, wantReason: "DrainingExporters",
			wantMessage: "2 exporters disabled; their pods go once unleased for 1m0s"},
		{name: "recycling released pods",
			in:         progressInput{Retiring: 1, Outdated: 1},
			wantStatus: metav1.ConditionTrue, wantReason: "Recycling", wantMessage: "deleting 1 released pods"},
		{name: "rolling out",
			in:         progressInput{Outdated: 3, OutdatedLeased: 1, ScaleDown: scaleDownDecision{Waiting: true}},
			wantStatus: metav1.ConditionTrue, wantReason: "RollingOut", wantMessage: "3 pods outdated (1 leased, replaced after release)"},
		{name: "scale-down cooldown",
			in:         progressInput{Target: 2, ScaleDown: scaleDownDecision{Waiting: true, Excess: 1, Candidates: 3}},
			wantStatus: metav1.ConditionTrue, wantReason: "ScaleDownCooldown", wantMessage: "1 pods above target 2; waiting for the cooldown"},
		{name: "explicit scale-in waits for marks",
			in:         progressInput{Target: 2, RemovalsWaiting: 1, ScaleDown: scaleDownDecision{ExplicitExcess: 2, Excess: 2}},
			wantStatus: metav1.ConditionFalse, wantReason: "ExplicitScaleIn",
			wantMessage: "2 pods above target 2; scaleInPolicy Explicit removes only pods annotated qemu-kubelet.io/remove=true"},
		{name: "marked leased pods wait for release",
			in:         progressInput{RemovalsWaiting: 1},
			wantStatus: metav1.ConditionFalse, wantReason: "RemovalWaitsForRelease",
			wantMessage: "1 pods marked qemu-kubelet.io/remove=true are leased; they go once released"},
		{name: "scaling down",
			in:         progressInput{Target: 1, ScaleDown: scaleDownDecision{Excess: 3, Candidates: 2}},
			wantStatus: metav1.ConditionTrue, wantReason: "ScalingDown", wantMessage: "deleting 2 pods towards 1"},
		{name: "excess without candidates is complete",
			in:         progressInput{Target: 1, Updated: 3, ScaleDown: scaleDownDecision{Excess: 2}},
			wantStatus: metav1.ConditionFalse, wantReason: "Complete", wantMessage: "3 pods at the current template"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := progressing(tc.in)
			assert.Equal(t, "Progressing", c.Type)
			assert.Equal(t, tc.wantStatus, c.Status)
			assert.Equal(t, tc.wantReason, c.Reason)
			assert.Equal(t, tc.wantMessage, c.Message)
		})
	}
}
