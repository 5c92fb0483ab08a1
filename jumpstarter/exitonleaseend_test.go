package jumpstarter_test

import (
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/pb"
)

// With ExitOnLeaseEnd (upstream's exitOnLeaseEnd) the end of the first
// lease ends the exporter: the afterLease hook runs, the lease state
// policy's reset does not (the target serves no other lease), AVAILABLE is
// never reported after the lease, the exporter unregisters and Run ends
// with ErrExitOnLeaseEnd, StateStopped.
func TestExitOnLeaseEnd(t *testing.T) {
	powerOff := &jumpstarter.Hook{Actions: []jumpstarter.HookStep{{Action: jumpstarter.HookPowerOff}}, OnFailure: jumpstarter.OnFailureWarn}
	for sub, hooks := range map[string]jumpstarter.LeaseHooks{
		"no afterLease hook":   {ResetAfterLease: true},
		"with afterLease hook": {ResetAfterLease: true, AfterLease: powerOff},
	} {
		t.Run(sub, func(t *testing.T) {
			ht := &hookTarget{fakeTarget: newFakeTarget()}
			e := startEnv(t, true, func(cfg *jumpstarter.Config) {
				cfg.Target, cfg.Hooks, cfg.ExitOnLeaseEnd = ht, hooks, true
			})
			ctx := ctxT(t, 60*time.Second)
			_, err := e.ctrl.WaitExporter(ctx, ns, name, online)
			require.NoError(t, err, "waiting for the exporter to be online")
			require.NoError(t, e.ctrl.AssignLease(ns, "lease-1", name, "alice"))
			_, err = e.ctrl.WaitExporter(ctx, ns, name, leaseReady)
			require.NoError(t, err, "waiting for the lease to be ready")
			require.NoError(t, e.ctrl.EndLease(ns, "lease-1"))
			select {
			case err := <-e.done:
				require.ErrorIs(t, err, jumpstarter.ErrExitOnLeaseEnd)
				e.done <- nil // for the cleanup's stop
			case <-ctx.Done():
				t.Fatal("Run did not end after the lease ended")
			}
			st, _ := e.ctrl.ExporterState(ns, name)
			history := slices.Compact(after(st.StatusHistory, pb.ExporterStatus_EXPORTER_STATUS_LEASE_READY))
			if hooks.AfterLease != nil {
				assert.Equal(t, []pb.ExporterStatus{pb.ExporterStatus_EXPORTER_STATUS_LEASE_READY, pb.ExporterStatus_EXPORTER_STATUS_AFTER_LEASE_HOOK, pb.ExporterStatus_EXPORTER_STATUS_OFFLINE}, history)
				assert.False(t, ht.Powered(), "the afterLease hook powered the target off")
			} else {
				assert.Equal(t, []pb.ExporterStatus{pb.ExporterStatus_EXPORTER_STATUS_LEASE_READY, pb.ExporterStatus_EXPORTER_STATUS_OFFLINE}, history)
			}
			assert.Zero(t, ht.resetCount(), "no reset: the target serves no other lease")
			assert.True(t, st.Unregistered, "unregistered at lease end")
			assert.Equal(t, jumpstarter.StateStopped, e.rec.last().state)
		})
	}
}
