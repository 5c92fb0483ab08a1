package e2e

import (
	"context"
	"crypto/md5"
	"encoding/hex"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
)

// testClassScaleInPaused runs a set of real VMs that takes its image and
// parameters from a VirtualTargetClass, and checks the scale-in policies:
//   - the merged parameters reach the guest (its environment disk, whose
//     files the test image prints with their md5 on the console);
//   - Oldest removes exactly the oldest unleased pod, never the leased
//     (even older) one;
//   - a pod marked qemu-kubelet.io/remove goes under Oldest too, and
//     spec.replicas drops with it, no replacement;
//   - Explicit removes nothing on a scale-down, a leased marked pod waits
//     for its release;
//   - paused stops creates and removals; unpaused, the marked pod goes.
//
// Every pod the set ever created is counted by UID: 4.
func (e *exsEnv) testClassScaleInPaused(t *testing.T) {
	ctx := context.Background()
	const name = "scalein"
	class := &v1alpha1.VirtualTargetClass{
		ObjectMeta: metav1.ObjectMeta{Name: "e2e-small", Namespace: e.ns},
		Spec: v1alpha1.VirtualTargetClassSpec{
			Parameters:  &runtime.RawExtension{Raw: []byte(`{"board":{"arch":"x86_64","ram":"256M"},"tags":["class"]}`)},
			PodDefaults: &v1alpha1.ClassPodDefaults{Image: e.image},
		},
	}
	require.NoError(t, e.cl.Create(ctx, class))
	t.Cleanup(func() { _ = e.cl.Delete(context.Background(), class) })
	set := e.newSet(name, "", 2, 0) // the image comes from the class
	set.Spec.ClassName = class.Name
	set.Spec.Parameters = &runtime.RawExtension{Raw: []byte(`{"board":{"ram":"512M"},"tags":["set"],"owner":"e2e"}`)}
	set.Spec.ScaleInPolicy = v1alpha1.ScaleInOldest
	created := e.recordCreates(t, name)
	e.createSet(t, set)

	// 1. Two VMs from the class's image; the merged parameters on the pods,
	// the status and in the guest.
	const merged = `{"board":{"arch":"x86_64","ram":"512M"},"owner":"e2e","tags":["set"]}`
	s, pods := e.waitCounts(t, name, counts{2, 2, 2, 2, 0}, 2*vmBoot)
	require.NotNil(t, s.Status.Parameters)
	assert.JSONEq(t, merged, string(s.Status.Parameters.Raw))
	require.NotNil(t, s.Status.Class)
	assert.Equal(t, "e2e-small", s.Status.Class.Name)
	envJSON, _ := json.MarshalIndent(map[string]string{v1alpha1.ParametersEnv: merged}, "", "  ")
	sum := md5.Sum(append(envJSON, '\n'))
	wantLine := "QK-CONFIG env env.json " + hex.EncodeToString(sum[:])
	for _, p := range pods {
		assert.Equal(t, e.image, p.Spec.Containers[0].Image, "pod %s: image from the class", p.Name)
		assert.Equal(t, merged, p.Annotations[v1alpha1.ParametersAnnotation], "pod %s", p.Name)
		assert.True(t, e.booted(p), "pod %s: booted", p.Name)
		assert.Contains(t, e.console(p), wantLine, "pod %s: the guest reads the merged parameters from its environment disk", p.Name)
	}
	old := byAge(pods)

	// 2. Two more, created at least a second later (creation timestamps
	// have 1 s resolution).
	time.Sleep(1100 * time.Millisecond)
	e.kubectl(t, "scale", "exs/"+name, "--replicas=4")
	_, pods = e.waitCounts(t, name, counts{4, 4, 4, 4, 0}, 2*vmBoot)
	var fresh []corev1.Pod
	for _, p := range pods {
		if p.Name != old[0].Name && p.Name != old[1].Name {
			fresh = append(fresh, p)
		}
	}
	require.Len(t, fresh, 2)

	// 3. Lease the oldest pod (the one Oldest would pick first), then scale
	// to 3: the next oldest goes, the leased one stays.
	leased := old[0]
	e.kubectl(t, "label", "pod", leased.Name, v1alpha1.LeaseLabel+"=ci-oldest", v1alpha1.UsedLabel+"=true")
	e.waitCounts(t, name, counts{4, 4, 4, 3, 1}, time.Minute)
	e.kubectl(t, "scale", "exs/"+name, "--replicas=3")
	e.waitVMGone(t, old[1], 90*time.Second)
	_, pods = e.waitCounts(t, name, counts{3, 3, 3, 2, 1}, time.Minute)
	assert.ElementsMatch(t, []string{leased.Name, fresh[0].Name, fresh[1].Name}, podNames(pods),
		"Oldest removed exactly the oldest unleased pod %s", old[1].Name)

	// 4. Addressed removal under Oldest: the marked pod (not the oldest
	// unleased one) goes, spec.replicas 3 -> 2, nothing is created.
	e.kubectl(t, "annotate", "pod", fresh[1].Name, v1alpha1.RemoveAnnotation+"=true")
	e.waitVMGone(t, fresh[1], 90*time.Second)
	s, pods = e.waitCounts(t, name, counts{2, 2, 2, 1, 1}, time.Minute)
	assert.Equal(t, int32(2), *s.Spec.Replicas, "spec.replicas dropped with the removed pod")
	assert.ElementsMatch(t, []string{leased.Name, fresh[0].Name}, podNames(pods))

	// 5. Explicit: a scale to 1 removes nothing (target max(1, leased 1) =
	// 1, two pods) for longer than the 3 s cooldown.
	patchSet(t, e, name, `{"spec":{"scaleInPolicy":"Explicit","replicas":1}}`)
	s, _ = e.waitSet(t, name, time.Minute, "ExplicitScaleIn", func(s *v1alpha1.ExporterSet, _ []corev1.Pod) bool {
		c := setCondition(s, v1alpha1.ConditionProgressing)
		return s.Status.ObservedGeneration == s.Generation && c != nil && c.Reason == "ExplicitScaleIn"
	})
	time.Sleep(8 * time.Second)
	_, pods = e.waitCounts(t, name, counts{1, 2, 2, 1, 1}, time.Second)
	assert.ElementsMatch(t, []string{leased.Name, fresh[0].Name}, podNames(pods), "Explicit: no pod chosen")

	// A leased pod marked for removal stays while leased; replicas stay 1.
	e.kubectl(t, "annotate", "pod", leased.Name, v1alpha1.RemoveAnnotation+"=true")
	time.Sleep(5 * time.Second)
	s, pods = e.waitCounts(t, name, counts{1, 2, 2, 1, 1}, time.Second)
	assert.Contains(t, podNames(pods), leased.Name, "a leased pod is never removed")
	assert.Equal(t, int32(1), *s.Spec.Replicas)

	// 6. Paused: replicas 3 creates nothing, a marked pod stays.
	patchSet(t, e, name, `{"spec":{"paused":true,"replicas":3}}`)
	e.waitSet(t, name, time.Minute, "Paused", func(s *v1alpha1.ExporterSet, _ []corev1.Pod) bool {
		c := setCondition(s, v1alpha1.ConditionProgressing)
		return s.Status.ObservedGeneration == s.Generation && c != nil && c.Reason == "Paused" && c.Status == metav1.ConditionUnknown &&
			strings.Contains(c.Message, "would create 1 ")
	})
	e.kubectl(t, "annotate", "pod", fresh[0].Name, v1alpha1.RemoveAnnotation+"=true")
	time.Sleep(8 * time.Second)
	s, pods = e.waitSet(t, name, time.Second, "paused: nothing moved", func(s *v1alpha1.ExporterSet, pods []corev1.Pod) bool { return true })
	assert.ElementsMatch(t, []string{leased.Name, fresh[0].Name}, podNames(pods), "paused: nothing created, nothing removed")
	assert.Equal(t, int32(3), *s.Spec.Replicas)
	assert.Contains(t, setCondition(s, v1alpha1.ConditionProgressing).Message, "1 pods marked qemu-kubelet.io/remove=true wait")
	assert.Equal(t, 4, created.count(), "pods created: %v", created.names())

	// 7. Unpaused (with replicas 1 again): the marked free pod goes
	// (replicas 1 -> 0); the leased marked one stays until its release,
	// then goes too; nothing is ever created.
	patchSet(t, e, name, `{"spec":{"paused":false,"replicas":1}}`)
	e.waitVMGone(t, fresh[0], 90*time.Second)
	s, pods = e.waitCounts(t, name, counts{1, 1, 1, 0, 1}, time.Minute)
	assert.Equal(t, int32(0), *s.Spec.Replicas)
	assert.Equal(t, []string{leased.Name}, podNames(pods))
	e.kubectl(t, "label", "pod", leased.Name, v1alpha1.LeaseLabel+"-")
	e.waitVMGone(t, leased, 90*time.Second)
	s, _ = e.waitCounts(t, name, counts{0, 0, 0, 0, 0}, time.Minute)
	assert.Equal(t, int32(0), *s.Spec.Replicas)
	out := e.kubectl(t, "describe", "exs", name)
	for _, want := range []string{"ReplicasLowered", "Removed", "ScaleDown"} {
		assert.Contains(t, out, want, "kubectl describe exs")
	}
	assert.Equal(t, 4, created.count(), "pods created: %v", created.names())
}

// byAge sorts pods oldest first as the controller's Oldest policy does
// (creation time, then name).
func byAge(pods []corev1.Pod) []corev1.Pod {
	out := slices.Clone(pods)
	slices.SortFunc(out, func(a, b corev1.Pod) int {
		if c := a.CreationTimestamp.Compare(b.CreationTimestamp.Time); c != 0 {
			return c
		}
		return strings.Compare(a.Name, b.Name)
	})
	return out
}

// console returns pod's serial console log.
func (e *exsEnv) console(p corev1.Pod) string {
	b, _ := os.ReadFile(filepath.Join(e.stateDir, "vms", string(p.UID), qemu.ConsoleLogName))
	return string(b)
}

// kubectl runs kubectl against the env's cluster and fails t on error.
func (e *exsEnv) kubectl(t *testing.T, args ...string) string {
	t.Helper()
	out, err := e.c.Kubectl(context.Background(), args...)
	require.NoError(t, err, "kubectl %v: %s", args, out)
	return out
}

func patchSet(t *testing.T, e *exsEnv, name, patch string) {
	t.Helper()
	err := e.cl.Patch(context.Background(), &v1alpha1.ExporterSet{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: e.ns}},
		client.RawPatch(types.MergePatchType, []byte(patch)))
	require.NoError(t, err, "patch exporterset %s: %s", name, patch)
}
