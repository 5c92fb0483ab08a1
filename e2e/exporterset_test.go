package e2e

import (
	"context"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/provider/vmtest"
)

// vmBoot bounds one VM boot to Ready under TCG on a busy 2-core host.
const vmBoot = 3 * time.Minute

// TestExporterSet runs ExporterSets of real VM pods: the real
// exporterset-controller binary, a real control plane and scheduler, a
// qemu-kubelet node booting the test OS image from a real registry under
// QEMU TCG.
func TestExporterSet(t *testing.T) {
	e := startExsEnv(t)
	t.Run("WarmBufferLeaseScaleRecycle", e.testWarmBuffer)
	// FailingGuestsBackOff runs inside MissingImage's no-churn window: both
	// watch a set over 40 s, and the missing image's pods never start a VM.
	t.Run("MissingImageReplicaFailureNoChurn", func(t *testing.T) {
		m := e.startMissingImage(t)
		t.Run("FailingGuestsBackOff", e.testFailingGuests)
		m.finish(t)
	})
	t.Run("LeasePlugin", e.testLeasePlugin)
	t.Run("JumpstarterFromZero", e.testJumpstarterFromZero)
	t.Run("JumpstarterSnapshotStart", e.testJumpstarterSnapshot)
	t.Run("ClassScaleInOldestExplicitPaused", e.testClassScaleInPaused)
}

// testWarmBuffer: replicas 1 + minAvailable 2 -> 2 Ready VMs; a claim by
// the documented kubectl recipe -> a third VM; kubectl scale up; a Replace
// release deletes the used VM and a fresh one fills the buffer; scale to 0
// with a lease keeps the leased VM; a Reuse release keeps the pod.
func (e *exsEnv) testWarmBuffer(t *testing.T) {
	ctx := context.Background()
	const name = "warm"
	set := e.newSet(name, e.image, 1, 2)
	e.createSet(t, set)
	created := e.recordCreates(t, name)
	created.setStep("1 two Ready")
	// On failure, before the set is deleted (cleanups run last first):
	// which step made each pod, and the controller's account of it.
	t.Cleanup(func() {
		if t.Failed() {
			e.logSetHistory(t, name, created)
		}
	})

	// 1. Two Ready, unleased VMs.
	_, pods := e.waitCounts(t, name, counts{2, 2, 2, 2, 0}, 2*vmBoot)
	for _, p := range pods {
		assert.True(t, e.vmRunning(p), "pod %s: one QEMU", p.Name)
		assert.True(t, e.booted(p), "pod %s: Ready means booted (readiness probe on the guest's HTTP port)", p.Name)
		assert.Equal(t, e.node, p.Spec.NodeName)
		assert.Equal(t, name, metav1.GetControllerOf(&p).Name)
	}
	out, err := e.c.Kubectl(ctx, "get", "exs", name)
	require.NoError(t, err)
	assertColumns(t, out, name, "2", "2", "2", "2", "0")

	// 2. Claim one with the documented recipe: a third VM boots to Ready.
	created.setStep("2 claim")
	leased := e.claim(t, name, "ci-job-1")
	assert.Contains(t, podNames(pods), leased, "the recipe claims one of the Ready pods")
	_, pods = e.waitCounts(t, name, counts{3, 3, 3, 2, 1}, vmBoot)
	var leasedPod corev1.Pod
	for _, p := range pods {
		if p.Name == leased {
			leasedPod = p
			assert.Equal(t, "ci-job-1", p.Labels[v1alpha1.LeaseLabel])
			assert.Equal(t, "true", p.Labels[v1alpha1.UsedLabel])
		}
		assert.True(t, e.vmRunning(p), "pod %s: one QEMU", p.Name)
		assert.True(t, e.booted(p), "pod %s: booted", p.Name)
	}
	require.NotEmpty(t, leasedPod.UID)
	out, err = e.c.Kubectl(ctx, "get", "exs", name)
	require.NoError(t, err)
	assertColumns(t, out, name, "3", "3", "3", "2", "1")
	assert.Equal(t, []string{
		"qemu_kubelet_exporterset_available_replicas 2",
		"qemu_kubelet_exporterset_desired_replicas 3",
		"qemu_kubelet_exporterset_leased_replicas 1",
		"qemu_kubelet_exporterset_pending_leases 0",
		"qemu_kubelet_exporterset_ready_replicas 3",
		"qemu_kubelet_exporterset_replicas 3",
	}, e.metricLines(t, name), "controller /metrics for KEDA/Prometheus")

	// A second claim of the same pod by the recipe's label command fails:
	// without --overwrite kubectl refuses a pod already leased.
	_, err = e.c.Kubectl(ctx, "label", "pod", leased, v1alpha1.LeaseLabel+"=ci-job-2", v1alpha1.UsedLabel+"=true")
	require.Error(t, err)
	assert.Contains(t, err.Error(), "already has a value")

	// 3. kubectl scale up: 5 pods.
	created.setStep("3 scale to 5")
	_, err = e.c.Kubectl(ctx, "scale", "exs/"+name, "--replicas=5")
	require.NoError(t, err)
	_, pods = e.waitCounts(t, name, counts{5, 5, 5, 4, 1}, vmBoot)

	// 4. Release with Replace (remove the lease label): the used VM is
	// deleted, its QEMU stops, and a fresh VM fills the set back to 5.
	created.setStep("4 Replace release")
	_, err = e.c.Kubectl(ctx, "label", "pod", leased, v1alpha1.LeaseLabel+"-")
	require.NoError(t, err)
	e.waitVMGone(t, leasedPod, 90*time.Second)
	_, pods = e.waitCounts(t, name, counts{5, 5, 5, 5, 0}, vmBoot)
	assert.NotContains(t, podNames(pods), leased)
	for _, p := range pods {
		assert.NotContains(t, p.Labels, v1alpha1.UsedLabel, "pod %s: fresh pods carry no used mark", p.Name)
	}

	// 4b. A lease claimed and released at once (both before the controller
	// may have seen the lease) still retires the pod: the claim's used mark
	// is durable.
	created.setStep("4b quick claim and release")
	quick := e.claim(t, name, "ci-job-quick")
	_, err = e.c.Kubectl(ctx, "label", "pod", quick, v1alpha1.LeaseLabel+"-")
	require.NoError(t, err)
	for _, p := range pods {
		if p.Name == quick {
			e.waitVMGone(t, p, 90*time.Second)
		}
	}
	_, pods = e.waitCounts(t, name, counts{5, 5, 5, 5, 0}, vmBoot)
	assert.NotContains(t, podNames(pods), quick)

	// 5. Claim again, then scale to 0: the target is leased + minAvailable
	// = 3; the two newest unleased pods go (after the 3s cooldown), the
	// leased one stays.
	created.setStep("5 claim, scale to 0")
	leased = e.claim(t, name, "ci-job-3")
	_, pods = e.waitCounts(t, name, counts{5, 5, 5, 4, 1}, time.Minute)
	before := pods
	_, err = e.c.Kubectl(ctx, "scale", "exs/"+name, "--replicas=0")
	require.NoError(t, err)
	_, pods = e.waitCounts(t, name, counts{3, 3, 3, 2, 1}, 2*time.Minute)
	require.Contains(t, podNames(pods), leased, "scale-down never deletes the leased pod")
	var unleased []string // oldest first
	for _, p := range before {
		if p.Name != leased {
			unleased = append(unleased, p.Name)
		}
	}
	for _, p := range before {
		if !slices.Contains(podNames(pods), p.Name) {
			assert.Contains(t, unleased[2:], p.Name, "scale-down removes the newest unleased pods (oldest first: %v)", unleased)
			e.waitVMGone(t, p, 90*time.Second)
		}
	}

	// 6. Reuse: with replicas 3 (the target stays 3), removing the lease
	// label returns the pod to the buffer: the controller clears the used
	// mark, the pod keeps its UID and its VM keeps running.
	created.setStep("6 Reuse release")
	var reused corev1.Pod
	for _, p := range pods {
		if p.Name == leased {
			reused = p
		}
	}
	patch := client.RawPatch(types.MergePatchType, []byte(`{"spec":{"recyclePolicy":"Reuse","replicas":3}}`))
	require.NoError(t, e.cl.Patch(ctx, &v1alpha1.ExporterSet{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: e.ns}}, patch))
	// Release once the controller has seen the patch: it watches sets and
	// pods apart, so a release it saw first would go by the policy then in
	// force (Replace deletes the pod), as docs/exporterset.md says.
	e.waitSet(t, name, time.Minute, "the Reuse patch observed", func(s *v1alpha1.ExporterSet, _ []corev1.Pod) bool {
		return s.Status.ObservedGeneration == s.Generation
	})
	_, err = e.c.Kubectl(ctx, "label", "pod", leased, v1alpha1.LeaseLabel+"-")
	require.NoError(t, err)
	_, pods = e.waitSet(t, name, 2*time.Minute, "reused pod back in the buffer, 3 pods", func(s *v1alpha1.ExporterSet, pods []corev1.Pod) bool {
		if statusCounts(s) != (counts{3, 3, 3, 3, 0}) || len(pods) != 3 {
			return false
		}
		for _, p := range pods {
			if p.UID == reused.UID {
				_, used := p.Labels[v1alpha1.UsedLabel]
				_, lease := p.Labels[v1alpha1.LeaseLabel]
				return !used && !lease
			}
		}
		return false
	})
	assert.True(t, e.vmRunning(reused), "the reused VM keeps running")
	// It is claimable again with the same recipe; the target stays
	// max(3, 1+2) = 3, so nothing is created.
	again := e.claim(t, name, "ci-job-4")
	assert.Contains(t, podNames(pods), again)
	_, pods = e.waitCounts(t, name, counts{3, 3, 3, 2, 1}, time.Minute)

	// 7. A template change rolls the unleased VMs; the leased one stays
	// until released, then goes as outdated (Reuse does not keep an
	// outdated pod) and is replaced.
	created.setStep("7 rollout")
	var holder corev1.Pod
	for _, p := range pods {
		if p.Name == again {
			holder = p
		}
	}
	patch = client.RawPatch(types.MergePatchType, []byte(`{"spec":{"template":{"metadata":{"annotations":{"rev":"2"}}}}}`))
	require.NoError(t, e.cl.Patch(ctx, &v1alpha1.ExporterSet{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: e.ns}}, patch))
	_, pods = e.waitSet(t, name, 2*vmBoot, "unleased pods rolled, leased kept", func(s *v1alpha1.ExporterSet, pods []corev1.Pod) bool {
		if statusCounts(s) != (counts{3, 3, 3, 2, 1}) || s.Status.UpdatedReplicas != 2 || s.Status.ObservedGeneration != s.Generation || len(pods) != 3 {
			return false
		}
		for _, p := range pods {
			if (p.UID == holder.UID) != (p.Annotations["rev"] == "") {
				return false
			}
		}
		return true
	})
	require.Contains(t, podNames(pods), again, "a rollout never deletes the leased pod")
	created.setStep("7 release the outdated leased pod")
	_, err = e.c.Kubectl(ctx, "label", "pod", again, v1alpha1.LeaseLabel+"-")
	require.NoError(t, err)
	e.waitVMGone(t, holder, 90*time.Second)
	_, pods = e.waitSet(t, name, vmBoot, "all pods at the new template", func(s *v1alpha1.ExporterSet, pods []corev1.Pod) bool {
		return statusCounts(s) == (counts{3, 3, 3, 3, 0}) && s.Status.UpdatedReplicas == 3 && len(pods) == 3
	})
	for _, p := range pods {
		assert.Equal(t, "2", p.Annotations["rev"], "pod %s", p.Name)
		assert.True(t, e.booted(p), "pod %s: booted", p.Name)
	}

	out, err = e.c.Kubectl(ctx, "describe", "exs", name)
	require.NoError(t, err)
	for _, want := range []string{"SuccessfulCreate", "SuccessfulDelete", "Released", "ScaleDown", "Outdated", "Available", "Progressing"} {
		assert.Contains(t, out, want, "kubectl describe exs")
	}

	// Every pod the set created, counted by UID over the whole scenario:
	// 2 + 1 (lease) + 2 (scale up) + 1 (Replace) + 1 (quick lease) + 2
	// (rollout) + 1 (outdated leased pod released) = 10; no pod was created
	// twice.
	assert.Equal(t, 10, created.count(), "pods created (history below)")
}

// missingImage is the set of startMissingImage, watched for churn until
// finish.
type missingImage struct {
	e       *exsEnv
	name    string
	created *createRecorder
	uids    map[types.UID]bool
	since   time.Time // the no-churn window's start
}

// noChurnWindow is how long a failing set is watched for creates and
// deletes: several pull retries and backoffs of the node.
const noChurnWindow = 40 * time.Second

// startMissingImage: a set whose image does not exist never gets a Ready
// pod; the node reports ErrImagePull/ImagePullBackOff and the set reports
// ReplicaFailure with that reason. finish checks that the set then neither
// deletes nor recreates pods for at least noChurnWindow.
func (e *exsEnv) startMissingImage(t *testing.T) *missingImage {
	const name = "missing"
	image := e.reg + "/qemu-kubelet/does-not-exist:1"
	set := e.newSet(name, image, 2, 0)
	created := e.recordCreates(t, name)
	e.createSet(t, set)

	s, pods := e.waitSet(t, name, 2*time.Minute, "ReplicaFailure with the pull error", func(s *v1alpha1.ExporterSet, pods []corev1.Pod) bool {
		c := setCondition(s, v1alpha1.ConditionReplicaFailure)
		return c != nil && c.Status == metav1.ConditionTrue && (c.Reason == "ErrImagePull" || c.Reason == "ImagePullBackOff")
	})
	c := setCondition(s, v1alpha1.ConditionReplicaFailure)
	assert.Contains(t, c.Message, "does-not-exist", "the condition carries the pod's pull message")
	require.Len(t, pods, 2)
	for _, p := range pods {
		assert.Equal(t, corev1.PodPending, p.Status.Phase)
		assert.Equal(t, e.node, p.Spec.NodeName, "scheduled to the real node")
	}
	uids := map[types.UID]bool{}
	for _, p := range pods {
		uids[p.UID] = true
	}
	return &missingImage{e: e, name: name, created: created, uids: uids, since: time.Now()}
}

// finish waits out the rest of the no-churn window (the node retries, the
// set waits), checks that no pod was created or deleted over it, and
// deletes the set.
func (m *missingImage) finish(t *testing.T) {
	e, name := m.e, m.name
	time.Sleep(time.Until(m.since.Add(noChurnWindow)))
	t.Logf("exporterset %s: watched for churn over %s", name, time.Since(m.since).Round(time.Second))
	s, pods := e.waitSet(t, name, time.Second, "2 pods", func(_ *v1alpha1.ExporterSet, pods []corev1.Pod) bool { return len(pods) == 2 })
	for _, p := range pods {
		assert.True(t, m.uids[p.UID], "pod %s (%s) is one of the first two", p.Name, p.UID)
		cs := p.Status.ContainerStatuses
		require.Len(t, cs, 1)
		require.NotNil(t, cs[0].State.Waiting, "pod %s: %s", p.Name, podTag(&p))
		assert.Contains(t, []string{"ErrImagePull", "ImagePullBackOff"}, cs[0].State.Waiting.Reason)
	}
	assert.Equal(t, 2, m.created.count(), "pods created over the window: %v", m.created.names())
	c := setCondition(s, v1alpha1.ConditionReplicaFailure)
	require.NotNil(t, c)
	assert.Equal(t, metav1.ConditionTrue, c.Status)
	assert.Equal(t, counts{2, 2, 0, 0, 0}, statusCounts(s))
	if a := setCondition(s, v1alpha1.ConditionAvailable); assert.NotNil(t, a) {
		assert.Equal(t, metav1.ConditionFalse, a.Status)
	}

	out, err := e.c.Kubectl(context.Background(), "describe", "exs", name)
	require.NoError(t, err)
	assert.Contains(t, out, "ReplicaFailure")
	assert.Contains(t, out, "ImagePull")
	assert.NotContains(t, out, "SuccessfulDelete")

	// Deleting the set deletes its pods (garbage collector, foreground).
	e.deleteSet(t, name)
	pods, err = e.livePods(context.Background(), name)
	require.NoError(t, err)
	assert.Empty(t, pods)
}

// assertColumns checks the `kubectl get exs` row for name: DESIRED,
// CURRENT, READY, AVAILABLE, LEASED as given, then PENDING (0 outside
// Jumpstarter mode) and AGE.
func assertColumns(t *testing.T, out, name string, want ...string) {
	t.Helper()
	lines := strings.Split(strings.TrimSpace(out), "\n")
	require.Len(t, lines, 2, out)
	assert.Equal(t, []string{"NAME", "DESIRED", "CURRENT", "READY", "AVAILABLE", "LEASED", "PENDING", "AGE"}, strings.Fields(lines[0]))
	row := strings.Fields(lines[1])
	require.Len(t, row, 8, out)
	assert.Equal(t, "0", row[6], out)
	assert.Equal(t, append([]string{name}, want...), row[:6], out)
}

// testFailingGuests: a set whose VMs panic right after booting
// (restartPolicy Never: each pod fails, GuestPanicked). Failed pods are
// deleted and replaced, the first at once, then with a backoff of 10 s
// doubling; after 3 failures in a row ReplicaFailure carries the pod's
// reason. The VMs have no readiness probe, so each is Ready while its QEMU
// runs, as for any VM pod without one: that brief Ready must not count as a
// successful start.
func (e *exsEnv) testFailingGuests(t *testing.T) {
	const name = "panicky"
	set := e.newSet(name, e.panic, 1, 0)
	set.Spec.Template.Spec.RestartPolicy = corev1.RestartPolicyNever
	set.Spec.Template.Spec.Containers[0].ReadinessProbe = nil
	created := e.recordCreates(t, name)
	e.createSet(t, set)

	s, _ := e.waitSet(t, name, 3*time.Minute, "ReplicaFailure GuestPanicked", func(s *v1alpha1.ExporterSet, _ []corev1.Pod) bool {
		c := setCondition(s, v1alpha1.ConditionReplicaFailure)
		return c != nil && c.Status == metav1.ConditionTrue && c.Reason == "GuestPanicked"
	})
	assert.GreaterOrEqual(t, s.Status.ConsecutiveFailures, int32(3))
	// Observe 40 s more: with failures >= 3 the next replacement waits at
	// least 20 s, so at most 2 more pods appear (a hot loop of ~5 s boots
	// would make 8).
	n0 := created.count()
	time.Sleep(40 * time.Second)
	n1 := created.count()
	assert.LessOrEqual(t, n1-n0, 2, "pods created in 40 s after ReplicaFailure: %v", created.names())
	times := created.times()
	for i := 2; i < len(times); i++ {
		gap := times[i].Sub(times[i-1])
		// Creation timestamps have 1 s resolution; the backoff runs from
		// the failure, after the previous pod's boot.
		assert.GreaterOrEqual(t, gap, 9*time.Second, "creation %d came %s after the previous one: no backoff (creations %v)", i+1, gap, times)
	}
	s, _ = e.waitSet(t, name, time.Second, "status", func(*v1alpha1.ExporterSet, []corev1.Pod) bool { return true })
	if c := setCondition(s, v1alpha1.ConditionReplicaFailure); assert.NotNil(t, c) {
		assert.Equal(t, metav1.ConditionTrue, c.Status, "%+v", c)
		assert.Contains(t, c.Message, "panic")
	}
	// Deleting the set stops every VM it made.
	e.deleteSet(t, name)
	for _, uid := range created.uids() {
		assert.Empty(t, vmtest.QEMUPids(filepath.Join(e.stateDir, "vms", string(uid))), "QEMU of pod %s", uid)
	}
}
