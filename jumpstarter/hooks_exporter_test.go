package jumpstarter_test

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/emptypb"

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
	on := &jumpstarter.Hook{Actions: []jumpstarter.HookStep{{Action: jumpstarter.HookPowerOn}}, OnFailure: jumpstarter.OnFailureEndLease}
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
	on := &jumpstarter.Hook{Actions: []jumpstarter.HookStep{{Action: jumpstarter.HookPowerOn}}, Timeout: 300 * time.Millisecond, OnFailure: jumpstarter.OnFailureEndLease}
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
	on := &jumpstarter.Hook{Actions: []jumpstarter.HookStep{{Action: jumpstarter.HookPowerOn}}, OnFailure: jumpstarter.OnFailureWarn}
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
	on := &jumpstarter.Hook{Actions: []jumpstarter.HookStep{{Action: jumpstarter.HookPowerOn}}, OnFailure: jumpstarter.OnFailureEndLease}
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

// A reset that fails, alone or before an afterLease hook whatever its
// onFailure: the exporter reports AFTER_LEASE_HOOK_FAILED, goes offline
// and Run ends with ErrHookExit: a target that could not be reset serves
// no next lease.
func TestLeaseResetFailsExit(t *testing.T) {
	for _, afterHook := range []*jumpstarter.Hook{nil,
		{Actions: []jumpstarter.HookStep{{Action: jumpstarter.HookPowerOff}}, OnFailure: jumpstarter.OnFailureWarn},
		{Actions: []jumpstarter.HookStep{{Action: jumpstarter.HookPowerOff}}, OnFailure: jumpstarter.OnFailureEndLease},
	} {
		sub := "no afterLease hook"
		if afterHook != nil {
			sub = "afterLease hook with onFailure " + string(afterHook.OnFailure)
		}
		t.Run(sub, func(t *testing.T) {
			e, _ := startHooked(t, jumpstarter.LeaseHooks{ResetAfterLease: true, AfterLease: afterHook}, func(h *hookTarget) { h.resetErr = errors.New("disk gone") })
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
				t.Fatal("Run did not end after the reset failed")
			}
			st, _ := e.ctrl.ExporterState(ns, name)
			assert.Equal(t, []pb.ExporterStatus{pb.ExporterStatus_EXPORTER_STATUS_AFTER_LEASE_HOOK, pb.ExporterStatus_EXPORTER_STATUS_AFTER_LEASE_HOOK_FAILED, pb.ExporterStatus_EXPORTER_STATUS_OFFLINE},
				slices.Compact(after(st.StatusHistory, pb.ExporterStatus_EXPORTER_STATUS_AFTER_LEASE_HOOK)))
			assert.True(t, st.Unregistered, "offline: unregistered")
			e.rec.waitState(t, jumpstarter.StateFailed, 5*time.Second)
		})
	}
}

// A reset on a target that cannot be reset fails the hook with a clear
// error (here warn: the exporter goes on).
func TestLeaseResetUnsupportedTarget(t *testing.T) {
	e := startEnv(t, true, func(cfg *jumpstarter.Config) {
		cfg.Hooks = jumpstarter.LeaseHooks{AfterLease: &jumpstarter.Hook{Actions: []jumpstarter.HookStep{{Action: jumpstarter.HookReset}}, OnFailure: jumpstarter.OnFailureWarn}}
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
	on := &jumpstarter.Hook{Actions: []jumpstarter.HookStep{{Action: jumpstarter.HookPowerOn}}, Timeout: time.Minute, OnFailure: jumpstarter.OnFailureEndLease}
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

// execTarget is a hookTarget that runs commands in its "guest"
// (jumpstarter.GuestExecer): the first notReady calls find no guest agent,
// then each call answers result.
type execTarget struct {
	*hookTarget
	emu      sync.Mutex
	notReady int
	result   jumpstarter.GuestExecResult
	calls    [][]string
}

func (x *execTarget) GuestExec(_ context.Context, argv []string) (jumpstarter.GuestExecResult, error) {
	x.emu.Lock()
	defer x.emu.Unlock()
	x.calls = append(x.calls, slices.Clone(argv))
	if x.notReady > 0 {
		x.notReady--
		return jumpstarter.GuestExecResult{}, fmt.Errorf("VM vm-0: %w: no answer to the handshake", jumpstarter.ErrGuestAgentNotReady)
	}
	return x.result, nil
}

func (x *execTarget) execCalls() [][]string {
	x.emu.Lock()
	defer x.emu.Unlock()
	return slices.Clone(x.calls)
}

func startExec(t *testing.T, hooks jumpstarter.LeaseHooks, x *execTarget) *env {
	x.hookTarget = &hookTarget{fakeTarget: newFakeTarget()}
	return startEnv(t, true, func(cfg *jumpstarter.Config) {
		cfg.Target = x
		cfg.Hooks = hooks
	})
}

// A beforeLease exec step on a guest whose agent does not answer yet (a
// guest still booting): the step tries again until the agent answers,
// runs the command as given, and the lease is served.
func TestLeaseHookExecWaitsForGuestAgent(t *testing.T) {
	argv := []string{"/bin/sh", "-c", "echo ready > /run/lease"}
	x := &execTarget{notReady: 2}
	e := startExec(t, jumpstarter.LeaseHooks{BeforeLease: &jumpstarter.Hook{
		Actions: []jumpstarter.HookStep{{Action: jumpstarter.HookExec, Command: argv}}, Timeout: time.Minute, OnFailure: jumpstarter.OnFailureEndLease}}, x)
	ctx := ctxT(t, 60*time.Second)
	_, err := e.ctrl.WaitExporter(ctx, ns, name, online)
	require.NoError(t, err)
	require.NoError(t, e.ctrl.AssignLease(ns, "lease-1", name, "alice"))
	_, err = e.ctrl.WaitExporter(ctx, ns, name, leaseReady)
	require.NoError(t, err, "the lease is served once the command ran")
	assert.Equal(t, [][]string{argv, argv, argv}, x.execCalls(), "two tries without an agent, then the command, argv as given")
	assert.Contains(t, e.logs.String(), "lease hook")
}

// An afterLease exec step whose command exits non-zero fails the hook with
// the exit code and the printable end of stderr (endLease: reported, then
// AVAILABLE); one whose guest agent never answers fails at the hook's
// timeout, saying so.
func TestLeaseHookExecFails(t *testing.T) {
	t.Run("exit code", func(t *testing.T) {
		x := &execTarget{result: jumpstarter.GuestExecResult{ExitCode: 3, Stderr: []byte("rm: cannot remove '/x':\n Permission denied\x00\x1b[0m\n")}}
		e := startExec(t, jumpstarter.LeaseHooks{AfterLease: &jumpstarter.Hook{
			Actions: []jumpstarter.HookStep{{Action: jumpstarter.HookExec, Command: []string{"rm", "/x"}}}, OnFailure: jumpstarter.OnFailureEndLease}}, x)
		st := leaseThenEnd(t, e)
		assert.Contains(t, st.StatusMessage, "afterLease hook failed (onFailure=endLease): action exec: rm exited with code 3: rm: cannot remove '/x':  Permission denied??[0m")
	})
	t.Run("no guest agent within the timeout", func(t *testing.T) {
		x := &execTarget{notReady: 1 << 20}
		e := startExec(t, jumpstarter.LeaseHooks{AfterLease: &jumpstarter.Hook{
			Actions: []jumpstarter.HookStep{{Action: jumpstarter.HookExec, Command: []string{"true"}}}, Timeout: 2 * time.Second, OnFailure: jumpstarter.OnFailureEndLease}}, x)
		st := leaseThenEnd(t, e)
		assert.Contains(t, st.StatusMessage, "timed out after 2s in action exec: VM vm-0: the guest agent does not answer (yet)")
		assert.GreaterOrEqual(t, len(x.execCalls()), 2, "tried again within the timeout")
		assert.Contains(t, e.logs.String(), "waiting for the guest agent")
	})
	t.Run("a target that cannot exec", func(t *testing.T) {
		e := startEnv(t, true, func(cfg *jumpstarter.Config) {
			cfg.Hooks = jumpstarter.LeaseHooks{AfterLease: &jumpstarter.Hook{
				Actions: []jumpstarter.HookStep{{Action: jumpstarter.HookExec, Command: []string{"true"}}}, OnFailure: jumpstarter.OnFailureEndLease}}
		})
		st := leaseThenEnd(t, e)
		assert.Contains(t, st.StatusMessage, "action exec: this target cannot run commands in its guest")
	})
}

// leaseThenEnd runs one lease on e's exporter and waits for AVAILABLE
// after its afterLease hook failed (AFTER_LEASE_HOOK_FAILED).
func leaseThenEnd(t *testing.T, e *env) jstest.ExporterState {
	t.Helper()
	ctx := ctxT(t, 60*time.Second)
	_, err := e.ctrl.WaitExporter(ctx, ns, name, online)
	require.NoError(t, err)
	require.NoError(t, e.ctrl.AssignLease(ns, "lease-1", name, "alice"))
	_, err = e.ctrl.WaitExporter(ctx, ns, name, leaseReady)
	require.NoError(t, err)
	require.NoError(t, e.ctrl.EndLease(ns, "lease-1"))
	st, err := e.ctrl.WaitExporter(ctx, ns, name, func(s jstest.ExporterState) bool {
		return s.Lease == "" && s.Status == pb.ExporterStatus_EXPORTER_STATUS_AVAILABLE &&
			slices.Contains(s.StatusHistory, pb.ExporterStatus_EXPORTER_STATUS_AFTER_LEASE_HOOK_FAILED)
	})
	require.NoError(t, err, "AVAILABLE after AFTER_LEASE_HOOK_FAILED")
	return st
}

// A flash step flashes its image as flash_oci does, but with no registry
// credentials and through the node's fetch policy (the target gets the
// policy's dialler), its progress in the lease's LogStream; a registry
// reached over plain HTTP is refused before anything is pulled.
func TestLeaseHookFlash(t *testing.T) {
	lim := jumpstarter.NewTransferLimiter(1)
	policy := jumpstarter.ResourceOptions{Transfers: lim, Fetch: jumpstarter.FetchPolicy{NodeAddresses: testNode,
		AllowNets: []netip.Prefix{netip.MustParsePrefix("10.255.0.0/16")}}}
	var slotsTaken atomic.Int32 // the node's transfers running while the hook's flash ran
	flashHook := func(image string) func(*jumpstarter.Config) {
		withPolicy, target := withDisk(policy)
		return func(c *jumpstarter.Config) {
			withPolicy(c)
			target().onOCI = func() { slotsTaken.Store(int32(lim.Running())) }
			c.Hooks = jumpstarter.LeaseHooks{BeforeLease: &jumpstarter.Hook{Actions: []jumpstarter.HookStep{
				{Action: jumpstarter.HookFlash, Image: image, Partition: "bios"}}, Timeout: time.Minute, OnFailure: jumpstarter.OnFailureEndLease}}
		}
	}
	t.Run("flashed without credentials, through the policy", func(t *testing.T) {
		e, s, _ := leased(t, flashHook("10.255.0.2:5000/fw:1"))
		dt := e.cfg.Target.(*diskTarget)
		dt.mu.Lock()
		parts, creds, dials := slices.Clone(dt.ociParts), slices.Clone(dt.ociCreds), slices.Clone(dt.ociDials)
		dt.mu.Unlock()
		assert.Equal(t, []string{"bios=10.255.0.2:5000/fw:1"}, parts, "the hook flashed before the lease was served")
		assert.Equal(t, int32(1), slotsTaken.Load(), "the flash ran in a transfer slot")
		assert.Zero(t, lim.Running(), "and gave it back")
		assert.Equal(t, []*jumpstarter.RegistryCredentials{nil}, creds, "no credentials: what the node may pull for anyone")
		require.Len(t, dials, 1)
		require.NotNil(t, dials[0], "the pull dials through the node's fetch policy")
		ctx := ctxT(t, 30*time.Second)
		_, err := dials[0].DialContext(ctx, "tcp", "10.0.0.7:443")
		require.ErrorIs(t, err, jumpstarter.ErrInvalidArgument)
		assert.Contains(t, err.Error(), "address 10.0.0.7 is in a private range")

		st, err := s.Exporter.LogStream(ctx, &emptypb.Empty{})
		require.NoError(t, err)
		var lines []string
		for !slices.Contains(lines, "pulling 10.255.0.2:5000/fw:1") {
			r, err := st.Recv()
			require.NoError(t, err, "the flash's progress in the LogStream; got %q", lines)
			lines = append(lines, r.GetMessage())
		}
		assert.Contains(t, lines, "beforeLease hook: flash 10.255.0.2:5000/fw:1 onto bios")
	})
	t.Run("a plain-HTTP registry is refused before any pull", func(t *testing.T) {
		mutate := flashHook("127.0.0.1:5000/fw:1")
		var dt *diskTarget
		e := startEnv(t, true, func(c *jumpstarter.Config) { mutate(c); dt = c.Target.(*diskTarget) })
		ctx := ctxT(t, 60*time.Second)
		_, err := e.ctrl.WaitExporter(ctx, ns, name, online)
		require.NoError(t, err)
		require.NoError(t, e.ctrl.AssignLease(ns, "lease-1", name, "alice"))
		st, err := e.ctrl.WaitExporter(ctx, ns, name, func(s jstest.ExporterState) bool {
			return s.Status == pb.ExporterStatus_EXPORTER_STATUS_BEFORE_LEASE_HOOK_FAILED && s.Lease == ""
		})
		require.NoError(t, err)
		assert.Contains(t, st.StatusMessage, "action flash: flash_oci 127.0.0.1:5000/fw:1: invalid argument: registry 127.0.0.1:5000 is reached over plain HTTP")
		dt.mu.Lock()
		defer dt.mu.Unlock()
		assert.Empty(t, dt.ociParts, "nothing was pulled")
	})
}
