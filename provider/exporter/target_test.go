package exporter

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// anyPod names Pod for embedding (Pod has a method Pod).
type anyPod = Pod

// powerPod records which stop its exporter asked for.
type powerPod struct {
	anyPod // the rest is not used here
	calls  []string
}

func (p *powerPod) PowerOff(context.Context) error { p.calls = append(p.calls, "graceful"); return nil }

// nowPod can also stop the VM at once.
type nowPod struct{ powerPod }

func (p *nowPod) PowerOffNow(context.Context) error { p.calls = append(p.calls, "now"); return nil }

// TestTargetPowerOff: the power driver's off is the worker's immediate
// stop when the pod offers it, the graceful one otherwise; shutdown is
// always the graceful stop (ACPI power button within the pod's grace).
func TestTargetPowerOff(t *testing.T) {
	ctx := context.Background()
	now := &nowPod{}
	tgt := NewTarget(&Node{}, now)
	require.NoError(t, tgt.PowerOff(ctx))
	require.NoError(t, tgt.Shutdown(ctx))
	assert.Equal(t, []string{"now", "graceful"}, now.calls)

	old := &powerPod{}
	tgt = NewTarget(&Node{}, old)
	require.NoError(t, tgt.PowerOff(ctx))
	require.NoError(t, tgt.Shutdown(ctx))
	assert.Equal(t, []string{"graceful", "graceful"}, old.calls, "a pod without PowerOffNow stops gracefully")
}
