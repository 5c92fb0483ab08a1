package podstatus

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
)

func TestApplyVMSize(t *testing.T) {
	var st corev1.PodStatus
	ApplyVMSize(&st, nil)
	assert.Empty(t, st.Conditions)
	at := time.Date(2026, 11, 26, 9, 0, 0, 0, time.UTC)
	ApplyVMSize(&st, &VMSize{MemoryBytes: 2 << 30, DiskBytes: 20 << 30, AppliedMemoryBytes: 2 << 30, Changed: at})
	require.Len(t, st.Conditions, 1)
	c := st.Conditions[0]
	assert.Equal(t, ConditionVMResized, c.Type)
	assert.Equal(t, corev1.ConditionFalse, c.Status)
	assert.Equal(t, ReasonResizePendingPowerOn, c.Reason)
	assert.Equal(t, "memory 2Gi, disk 20Gi from the next power on (set through the Jumpstarter exporter)", c.Message)
	assert.True(t, c.LastTransitionTime.Time.Equal(at))
	st = corev1.PodStatus{}
	ApplyVMSize(&st, &VMSize{MemoryBytes: 2 << 30, AppliedMemoryBytes: 2 << 30})
	assert.Equal(t, corev1.ConditionTrue, st.Conditions[0].Status)
	assert.Equal(t, ReasonResizeApplied, st.Conditions[0].Reason)
}
