package jumpstarter_test

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/jstest"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/pb"
)

// hookTarget is a fakeTarget that can be reset (jumpstarter.Resetter)
// and whose power on and reset fail or hang on demand.
type hookTarget struct {
	*fakeTarget
	mu       sync.Mutex
	resets   int
	onErr    error         // PowerOn fails with it
	onHang   bool          // PowerOn waits for its context
	onGate   chan struct{} // PowerOn waits for it to close (nil: no wait)
	resetErr error
}

func (h *hookTarget) PowerOn(ctx context.Context) error {
	h.mu.Lock()
	gate := h.onGate
	h.mu.Unlock()
	if gate != nil {
		select {
		case <-gate:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	h.mu.Lock()
	err, hang := h.onErr, h.onHang
	h.mu.Unlock()
	if hang {
		<-ctx.Done()
		return ctx.Err()
	}
	if err != nil {
		return err
	}
	return h.fakeTarget.PowerOn(ctx)
}

func (h *hookTarget) ResetTarget(context.Context) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.resetErr != nil {
		return h.resetErr
	}
	h.resets++
	return nil
}

func (h *hookTarget) resetCount() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.resets
}

// startHooked starts an exporter with hooks over a hookTarget.
func startHooked(t *testing.T, hooks jumpstarter.LeaseHooks, set func(*hookTarget)) (*env, *hookTarget) {
	ht := &hookTarget{fakeTarget: newFakeTarget()}
	if set != nil {
		set(ht)
	}
	e := startEnv(t, true, func(cfg *jumpstarter.Config) {
		cfg.Target = ht
		cfg.Hooks = hooks
	})
	return e, ht
}

func statusIs(s pb.ExporterStatus) func(jstest.ExporterState) bool {
	return func(st jstest.ExporterState) bool { return st.Online && st.Status == s }
}

// after returns the statuses reported after the last `from` in history.
func after(history []pb.ExporterStatus, from pb.ExporterStatus) []pb.ExporterStatus {
	for j := len(history) - 1; j >= 0; j-- {
		if history[j] == from {
			return history[j:]
		}
	}
	return nil
}

// Two leases in a row with the lease state policy Reset and a
// beforeLease power on: each lease is served only after its hook, and
// each end resets the target before the exporter is available again.
func TestLeaseHooksResetBetweenLeases(t *testing.T) {
	on := &jumpstarter.Hook{Actions: []jumpstarter.HookAction{jumpstarter.HookPowerOn}, OnFailure: jumpstarter.OnFailureEndLease}
	e, ht := startHooked(t, jumpstarter.LeaseHooks{ResetAfterLease: true, BeforeLease: on}, nil)
	ctx := ctxT(t, 60*time.Second)
	_, err := e.ctrl.WaitExporter(ctx, ns, name, online)
	require.NoError(t, err)

	for i, lease := range []string{"lease-1", "lease-2"} {
		require.NoError(t, e.ctrl.AssignLease(ns, lease, name, "alice"))
		st, err := e.ctrl.WaitExporter(ctx, ns, name, leaseReady)
		require.NoError(t, err)
		assert.Equal(t, []pb.ExporterStatus{pb.ExporterStatus_EXPORTER_STATUS_BEFORE_LEASE_HOOK, pb.ExporterStatus_EXPORTER_STATUS_LEASE_READY},
			after(st.StatusHistory, pb.ExporterStatus_EXPORTER_STATUS_BEFORE_LEASE_HOOK), "the hook's status, then ready")
		ons, _ := ht.counts()
		assert.Equal(t, i+1, ons, "the beforeLease hook powered the target on")
		assert.Equal(t, i, ht.resetCount(), "lease %s starts after %d resets", lease, i)

		s, err := e.ctrl.NewClient(ns, "alice").Dial(ctx, lease)
		require.NoError(t, err)
		gs, err := s.GetStatus(ctx)
		require.NoError(t, err)
		assert.Equal(t, pb.ExporterStatus_EXPORTER_STATUS_LEASE_READY, gs.GetStatus())
		s.Close()

		require.NoError(t, e.ctrl.EndLease(ns, lease))
		st, err = e.ctrl.WaitExporter(ctx, ns, name, func(s jstest.ExporterState) bool {
			return s.Online && s.Lease == "" && s.Status == pb.ExporterStatus_EXPORTER_STATUS_AVAILABLE
		})
		require.NoError(t, err)
		assert.Equal(t, []pb.ExporterStatus{pb.ExporterStatus_EXPORTER_STATUS_AFTER_LEASE_HOOK, pb.ExporterStatus_EXPORTER_STATUS_AVAILABLE},
			after(st.StatusHistory, pb.ExporterStatus_EXPORTER_STATUS_AFTER_LEASE_HOOK))
		assert.Equal(t, i+1, ht.resetCount(), "the end of %s reset the target", lease)
	}
	assert.Contains(t, e.logs.String(), "lease hook", "the hooks are logged")
}

// A beforeLease hook that hangs past its timeout, with endLease: the
// lease is released, the client is never served, the status says why,
// and the reset still runs at the lease's end.
func TestLeaseHookBeforeTimesOutEndLease(t *testing.T) {
	on := &jumpstarter.Hook{Actions: []jumpstarter.HookAction{jumpstarter.HookPowerOn}, Timeout: 300 * time.Millisecond, OnFailure: jumpstarter.OnFailureEndLease}
	e, ht := startHooked(t, jumpstarter.LeaseHooks{ResetAfterLease: true, BeforeLease: on}, func(h *hookTarget) { h.onHang = true })
	ctx := ctxT(t, 60*time.Second)
	_, err := e.ctrl.WaitExporter(ctx, ns, name, online)
	require.NoError(t, err)
	require.NoError(t, e.ctrl.AssignLease(ns, "lease-1", name, "alice"))
	st, err := e.ctrl.WaitExporter(ctx, ns, name, func(s jstest.ExporterState) bool {
		return slices.Contains(s.StatusHistory, pb.ExporterStatus_EXPORTER_STATUS_BEFORE_LEASE_HOOK_FAILED) && s.Lease == ""
	})
	require.NoError(t, err)
	assert.Contains(t, st.StatusHistory, pb.ExporterStatus_EXPORTER_STATUS_BEFORE_LEASE_HOOK)
	assert.NotContains(t, st.StatusHistory, pb.ExporterStatus_EXPORTER_STATUS_LEASE_READY, "the client is never served")
	_, err = e.ctrl.WaitExporter(ctx, ns, name, statusIs(pb.ExporterStatus_EXPORTER_STATUS_AVAILABLE))
	require.NoError(t, err)
	st, _ = e.ctrl.ExporterState(ns, name)
	hist := after(st.StatusHistory, pb.ExporterStatus_EXPORTER_STATUS_BEFORE_LEASE_HOOK_FAILED)
	require.NotEmpty(t, hist)
	assert.Contains(t, hist, pb.ExporterStatus_EXPORTER_STATUS_AFTER_LEASE_HOOK, "the released lease's end resets the target")
	assert.Equal(t, 1, ht.resetCount())
	assert.Contains(t, e.logs.String(), "timed out")
}

// A beforeLease hook that fails with warn: the lease is served anyway and
// the status message carries the warning.
func TestLeaseHookBeforeFailsWarn(t *testing.T) {
	on := &jumpstarter.Hook{Actions: []jumpstarter.HookAction{jumpstarter.HookPowerOn}, OnFailure: jumpstarter.OnFailureWarn}
	e, _ := startHooked(t, jumpstarter.LeaseHooks{BeforeLease: on}, func(h *hookTarget) { h.onErr = errors.New("no power") })
	ctx := ctxT(t, 60*time.Second)
	_, err := e.ctrl.WaitExporter(ctx, ns, name, online)
	require.NoError(t, err)
	require.NoError(t, e.ctrl.AssignLease(ns, "lease-1", name, "alice"))
	st, err := e.ctrl.WaitExporter(ctx, ns, name, leaseReady)
	require.NoError(t, err)
	assert.Contains(t, st.StatusMessage, "beforeLease hook warning: action powerOn: no power")
}

// An afterLease hook that fails with endLease: AFTER_LEASE_HOOK_FAILED
// for a while, then AVAILABLE with the failure in its message (controllers
// assign leases only to AVAILABLE exporters, as upstream's does), and the
// exporter takes the next lease.
func TestLeaseHookAfterFailsEndLease(t *testing.T) {
	on := &jumpstarter.Hook{Actions: []jumpstarter.HookAction{jumpstarter.HookPowerOn}, OnFailure: jumpstarter.OnFailureEndLease}
	e, ht := startHooked(t, jumpstarter.LeaseHooks{AfterLease: on}, func(h *hookTarget) { h.onErr = errors.New("no power") })
	ctx := ctxT(t, 60*time.Second)
	_, err := e.ctrl.WaitExporter(ctx, ns, name, online)
	require.NoError(t, err)
	require.NoError(t, e.ctrl.AssignLease(ns, "lease-1", name, "alice"))
	_, err = e.ctrl.WaitExporter(ctx, ns, name, leaseReady)
	require.NoError(t, err)
	require.NoError(t, e.ctrl.EndLease(ns, "lease-1"))
	// Wait for AVAILABLE after the failed status: a controller assigns the
	// next lease only then.
	st, err := e.ctrl.WaitExporter(ctx, ns, name, func(s jstest.ExporterState) bool {
		return s.Online && s.Lease == "" && s.Status == pb.ExporterStatus_EXPORTER_STATUS_AVAILABLE &&
			slices.Contains(s.StatusHistory, pb.ExporterStatus_EXPORTER_STATUS_AFTER_LEASE_HOOK_FAILED)
	})
	require.NoError(t, err, "AVAILABLE again after AFTER_LEASE_HOOK_FAILED")
	assert.Equal(t, []pb.ExporterStatus{pb.ExporterStatus_EXPORTER_STATUS_AFTER_LEASE_HOOK, pb.ExporterStatus_EXPORTER_STATUS_AFTER_LEASE_HOOK_FAILED, pb.ExporterStatus_EXPORTER_STATUS_AVAILABLE},
		after(st.StatusHistory, pb.ExporterStatus_EXPORTER_STATUS_AFTER_LEASE_HOOK), "the failure is reported, then AVAILABLE")
	assert.Contains(t, st.StatusMessage, "afterLease hook failed (onFailure=endLease): action powerOn: no power", "AVAILABLE keeps the failure in its message")
	assert.Equal(t, 0, ht.resetCount(), "Keep: no reset")

	ht.mu.Lock()
	ht.onErr = nil
	ht.mu.Unlock()
	require.NoError(t, e.ctrl.AssignLease(ns, "lease-2", name, "alice"))
	_, err = e.ctrl.WaitExporter(ctx, ns, name, leaseReady)
	require.NoError(t, err, "the exporter takes the next lease")
}

// A reset that fails (no afterLease hook: onFailure exit): the exporter
// reports AFTER_LEASE_HOOK_FAILED, goes offline and Run ends with
// ErrHookExit: a target that could not be reset serves no next lease.
func TestLeaseResetFailsExit(t *testing.T) {
	e, _ := startHooked(t, jumpstarter.LeaseHooks{ResetAfterLease: true}, func(h *hookTarget) { h.resetErr = errors.New("disk gone") })
	ctx := ctxT(t, 60*time.Second)
	_, err := e.ctrl.WaitExporter(ctx, ns, name, online)
	require.NoError(t, err)
	require.NoError(t, e.ctrl.AssignLease(ns, "lease-1", name, "alice"))
	_, err = e.ctrl.WaitExporter(ctx, ns, name, leaseReady)
	require.NoError(t, err)
	require.NoError(t, e.ctrl.EndLease(ns, "lease-1"))
	select {
	case err := <-e.done:
		require.ErrorIs(t, err, jumpstarter.ErrHookExit)
		assert.ErrorContains(t, err, "disk gone")
		e.done <- nil // for the cleanup's stop
	case <-ctx.Done():
		t.Fatal("Run did not end after the reset failed with onFailure exit")
	}
	st, _ := e.ctrl.ExporterState(ns, name)
	assert.Equal(t, []pb.ExporterStatus{pb.ExporterStatus_EXPORTER_STATUS_AFTER_LEASE_HOOK, pb.ExporterStatus_EXPORTER_STATUS_AFTER_LEASE_HOOK_FAILED, pb.ExporterStatus_EXPORTER_STATUS_OFFLINE},
		slices.Compact(after(st.StatusHistory, pb.ExporterStatus_EXPORTER_STATUS_AFTER_LEASE_HOOK)))
	assert.True(t, st.Unregistered, "offline: unregistered")
	e.rec.waitState(t, jumpstarter.StateFailed, 5*time.Second)
}

// A reset on a target that cannot be reset fails the hook with a clear
// error (here warn: the exporter goes on).
func TestLeaseResetUnsupportedTarget(t *testing.T) {
	e := startEnv(t, true, func(cfg *jumpstarter.Config) {
		cfg.Hooks = jumpstarter.LeaseHooks{AfterLease: &jumpstarter.Hook{Actions: []jumpstarter.HookAction{jumpstarter.HookReset}, OnFailure: jumpstarter.OnFailureWarn}}
	})
	ctx := ctxT(t, 60*time.Second)
	_, err := e.ctrl.WaitExporter(ctx, ns, name, online)
	require.NoError(t, err)
	require.NoError(t, e.ctrl.AssignLease(ns, "lease-1", name, "alice"))
	_, err = e.ctrl.WaitExporter(ctx, ns, name, leaseReady)
	require.NoError(t, err)
	require.NoError(t, e.ctrl.EndLease(ns, "lease-1"))
	st, err := e.ctrl.WaitExporter(ctx, ns, name, func(s jstest.ExporterState) bool {
		return s.Lease == "" && s.Status == pb.ExporterStatus_EXPORTER_STATUS_AVAILABLE && slices.Contains(s.StatusHistory, pb.ExporterStatus_EXPORTER_STATUS_AFTER_LEASE_HOOK)
	})
	require.NoError(t, err)
	assert.Contains(t, st.StatusMessage, "this target cannot be reset")
}

// While a beforeLease hook runs, a client that dials the lease sees
// BEFORE_LEASE_HOOK and its driver calls are refused; the hook failing
// with endLease releases the lease, and LEASE_READY is never reported.
func TestLeaseHookBeforeGatesDrivers(t *testing.T) {
	gate := make(chan struct{})
	on := &jumpstarter.Hook{Actions: []jumpstarter.HookAction{jumpstarter.HookPowerOn}, Timeout: time.Minute, OnFailure: jumpstarter.OnFailureEndLease}
	e, ht := startHooked(t, jumpstarter.LeaseHooks{BeforeLease: on}, func(h *hookTarget) { h.onGate = gate })
	ctx := ctxT(t, 60*time.Second)
	_, err := e.ctrl.WaitExporter(ctx, ns, name, online)
	require.NoError(t, err)
	require.NoError(t, e.ctrl.AssignLease(ns, "lease-1", name, "alice"))
	_, err = e.ctrl.WaitExporter(ctx, ns, name, statusIs(pb.ExporterStatus_EXPORTER_STATUS_BEFORE_LEASE_HOOK))
	require.NoError(t, err)

	s, err := e.ctrl.NewClient(ns, "alice").Dial(ctx, "lease-1")
	require.NoError(t, err)
	defer s.Close()
	gs, err := s.GetStatus(ctx)
	require.NoError(t, err)
	assert.Equal(t, pb.ExporterStatus_EXPORTER_STATUS_BEFORE_LEASE_HOOK, gs.GetStatus())
	rep, err := s.GetReport(ctx)
	require.NoError(t, err)
	power, ok := jstest.FindDriver(rep, "power")
	require.True(t, ok)
	_, err = s.Call(ctx, power.Uuid, "off")
	require.Error(t, err, "no driver call while the beforeLease hook runs")
	assert.Contains(t, err.Error(), "not ready")
	_, offs := ht.counts()
	assert.Zero(t, offs)

	ht.mu.Lock()
	ht.onErr = errors.New("board not found")
	ht.mu.Unlock()
	close(gate)
	st, err := e.ctrl.WaitExporter(ctx, ns, name, func(s jstest.ExporterState) bool {
		return s.Status == pb.ExporterStatus_EXPORTER_STATUS_BEFORE_LEASE_HOOK_FAILED && s.Lease == ""
	})
	require.NoError(t, err)
	assert.Contains(t, st.StatusMessage, "beforeLease hook failed (onFailure=endLease): action powerOn: board not found")
	assert.NotContains(t, st.StatusHistory, pb.ExporterStatus_EXPORTER_STATUS_LEASE_READY)
}
