package e2e

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apiextv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	jsv1 "github.com/qemu-kubelet/qemu-kubelet/api/jumpstarter/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	vtv1 "github.com/qemu-kubelet/qemu-kubelet/api/virtualtarget/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/controller"
	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	"github.com/qemu-kubelet/qemu-kubelet/oci/ocitest"
)

// upstreamRole is the Role Jumpstarter's operator binds a provisioner's
// ServiceAccount to, rule for rule.
func upstreamRole(ns, name string) *rbacv1.Role {
	all := []string{"get", "list", "watch", "create", "update", "patch", "delete"}
	read := []string{"get", "list", "watch"}
	return &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}, Rules: []rbacv1.PolicyRule{
		{APIGroups: []string{vtv1.GroupVersion.Group}, Resources: []string{"exportersets"}, Verbs: read},
		{APIGroups: []string{vtv1.GroupVersion.Group}, Resources: []string{"exportersets/status", "exportersets/scale"}, Verbs: []string{"get", "update", "patch"}},
		{APIGroups: []string{vtv1.GroupVersion.Group}, Resources: []string{"exportersets/finalizers"}, Verbs: []string{"update"}},
		{APIGroups: []string{vtv1.GroupVersion.Group}, Resources: []string{"virtualtargetclasses"}, Verbs: read},
		{APIGroups: []string{"jumpstarter.dev"}, Resources: []string{"exporters"}, Verbs: all},
		{APIGroups: []string{"jumpstarter.dev"}, Resources: []string{"leases"}, Verbs: read},
		{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: all},
		{APIGroups: []string{""}, Resources: []string{"events"}, Verbs: []string{"create", "patch"}},
		{APIGroups: []string{""}, Resources: []string{"secrets"}, Verbs: []string{"get", "list", "watch", "create", "update", "patch"}},
		{APIGroups: []string{""}, Resources: []string{"configmaps"}, Verbs: read},
		{APIGroups: []string{"coordination.k8s.io"}, Resources: []string{"leases"}, Verbs: all},
	}}
}

// startProvisioner runs the exporterset-controller as Jumpstarter's
// operator runs a provisioner: upstream's flags, NAMESPACE, and a
// ServiceAccount identity bound to upstream's Role alone. It returns the
// log's path and the health address.
func (e *exsEnv) startProvisioner(t *testing.T) (string, string) {
	t.Helper()
	ctx := context.Background()
	const sa = "exs-provisioner"
	cs := e.c.Client()
	_, err := cs.CoreV1().ServiceAccounts(e.ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: sa}}, metav1.CreateOptions{})
	require.NoError(t, err)
	_, err = cs.RbacV1().Roles(e.ns).Create(ctx, upstreamRole(e.ns, sa), metav1.CreateOptions{})
	require.NoError(t, err)
	_, err = cs.RbacV1().RoleBindings(e.ns).Create(ctx, &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Name: sa},
		RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: sa},
		Subjects: []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Namespace: e.ns, Name: sa}}}, metav1.CreateOptions{})
	require.NoError(t, err)
	// The ServiceAccount's user name and groups, as its token would
	// authenticate (a client certificate here: RBAC matches the names).
	kc, err := e.c.UserKubeconfig("system:serviceaccount:"+e.ns+":"+sa, "system:serviceaccounts", "system:serviceaccounts:"+e.ns)
	require.NoError(t, err)

	tmp := t.TempDir()
	bin := goBuild(t, ocitest.RepoRoot(t), tmp, "./cmd/exporterset-controller")
	health := fmt.Sprintf("127.0.0.1:%d", testutil.FreePort(t))
	logPath := filepath.Join(tmp, "exporter-set-controller.log")
	t.Setenv("NAMESPACE", e.ns) // the child inherits it
	startProcess(t, "exporter-set-controller", logPath, bin, "--provisioner="+vtv1.DefaultProvisioner, "--leader-elect",
		"--health-probe-bind-address="+health, "--metrics-bind-address=0", "--kubeconfig="+kc, "-v", "2")
	return logPath, health
}

// installUpstreamCRDs installs upstream's virtualtarget.jumpstarter.dev
// CRDs (the project's copies) and waits until they are served.
func (e *exsEnv) installUpstreamCRDs(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	out, err := e.c.Kubectl(ctx, "apply", "--server-side", "-f", filepath.Join(ocitest.RepoRoot(t), "config", "virtualtarget", "crd"))
	require.NoError(t, err, out)
	require.NoError(t, vtv1.AddToScheme(e.cl.Scheme()))
	require.NoError(t, wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		return e.cl.List(ctx, &vtv1.ExporterSetList{}, client.InNamespace(e.ns)) == nil &&
			e.cl.List(ctx, &vtv1.VirtualTargetClassList{}, client.InNamespace(e.ns)) == nil, nil
	}), "virtualtarget CRDs never served")
}

// TestUpstreamExporterSet: an ExporterSet of upstream Jumpstarter's own
// API (virtualtarget.jumpstarter.dev) whose class names provisioner
// qemu-kubelet.io, served by the exporterset-controller started as
// Jumpstarter's operator starts a provisioner (upstream's flags,
// NAMESPACE, a ServiceAccount bound to upstream's Role alone). At
// minReplicas 0 it keeps a cold Exporter and no VM; a Lease created then
// gets a VM from zero through the Jumpstarter double: the pod's Exporter
// and its exporter-config-<exporter> Secret are made, the VM boots on the
// qemu-kubelet node, its exporter registers and the lease is served (the
// test client drives power, console and the guest's HTTP port named by the
// template's Qemu driver hostfwd). With minReplicas 1, the release retires
// the used VM (ExitAndReplace) and a fresh one replaces it. A set of class
// qemu.jumpstarter.dev in the same namespace is never touched (no status,
// no pod, no event) and the controller's log shows no Forbidden.
func TestUpstreamExporterSet(t *testing.T) {
	e := startExsEnv(t)
	js := e.jumpstarter(t)
	ctx := context.Background()
	// After our own controller started (it then serves our API alone): the
	// provisioner below serves upstream's.
	e.installUpstreamCRDs(t)
	_, err := e.c.Client().CoreV1().ConfigMaps(e.ns).Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "jumpstarter-service-ca-cert"},
		Data: map[string]string{"ca.crt": string(js.ctl.CABundle())}}, metav1.CreateOptions{})
	require.NoError(t, err)

	q := `{"qemuKubelet":{"image":%q},"resources":{"cpu":"1","memory":"256Mi"}}`
	sched := &vtv1.SchedulingSpec{
		NodeSelector: map[string]string{"kubernetes.io/hostname": e.node},
		Tolerations:  []corev1.Toleration{{Key: "virtual-kubelet.io/provider", Operator: corev1.TolerationOpEqual, Value: "qemu", Effect: corev1.TaintEffectNoSchedule}},
		Resources: &corev1.ResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("100m"),
			corev1.ResourceMemory: resource.MustParse("64Mi")}},
	}
	ours := &vtv1.VirtualTargetClass{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "qk"}, Spec: vtv1.VirtualTargetClassSpec{
		Provisioner: vtv1.DefaultProvisioner, Scheduling: sched, Parameters: &apiextv1.JSON{Raw: fmt.Appendf(nil, q, e.image)}}}
	theirs := &vtv1.VirtualTargetClass{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "qemu"}, Spec: vtv1.VirtualTargetClassSpec{
		Provisioner: "qemu.jumpstarter.dev", Parameters: &apiextv1.JSON{Raw: []byte(`{"arch":"x86_64"}`)}}}
	labels := map[string]string{"board": "qemu-up", "virtual": "true"}
	set := &vtv1.ExporterSet{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "up"}, Spec: vtv1.ExporterSetSpec{
		MinReplicas: 0, MaxReplicas: ptr.To[int32](2), RecycleStrategy: vtv1.RecycleStrategyExitAndReplace,
		ScaleDownCooldown: &metav1.Duration{Duration: 3 * time.Second}, VirtualTargetClassName: "qk",
		Selector: metav1.LabelSelector{MatchLabels: labels},
		Template: vtv1.ExporterSetTemplate{Metadata: vtv1.TemplateMetadata{Labels: labels}, Spec: vtv1.ExporterTemplateSpec{Drivers: []vtv1.DriverConfig{
			{Name: "qemu", Type: controller.DriverTypeQemu, Config: &apiextv1.JSON{Raw: []byte(`{"smp":1,"mem":"256M","hostfwd":{"http":{"guestport":8080}}}`)}},
			{Name: "power", Type: controller.DriverTypeQemuPower},
			{Name: "console", Type: controller.DriverTypeQemuSerial},
		}}}}}
	other := &vtv1.ExporterSet{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "other"}, Spec: vtv1.ExporterSetSpec{
		MinReplicas: 1, VirtualTargetClassName: "qemu", Selector: metav1.LabelSelector{MatchLabels: map[string]string{"board": "theirs"}},
		Template: vtv1.ExporterSetTemplate{Metadata: vtv1.TemplateMetadata{Labels: map[string]string{"board": "theirs"}}}}}
	for _, o := range []client.Object{ours, theirs, other, set} {
		require.NoError(t, e.cl.Create(ctx, o), "create %s", o.GetName())
	}
	require.NoError(t, e.cl.Get(ctx, client.ObjectKeyFromObject(other), other))
	otherRV := other.ResourceVersion

	logPath, health := e.startProvisioner(t)
	// Runs before the provisioner stops (cleanups are LIFO): the set goes,
	// the garbage collector deletes its pods, the node stops their VMs.
	t.Cleanup(func() { e.deleteUpstreamSet(t, "up") })
	require.Eventually(t, func() bool {
		resp, err := http.Get("http://" + health + "/healthz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}, 30*time.Second, 200*time.Millisecond, "/healthz on the probe address")

	// 1. At zero: the cold Exporter (the template's labels), no VM.
	require.Eventually(t, func() bool {
		var x jsv1.Exporter
		err := e.cl.Get(ctx, types.NamespacedName{Namespace: e.ns, Name: "up-cold"}, &x)
		return err == nil && x.Labels["board"] == "qemu-up" && x.Labels[controller.UpstreamExporterSetLabel] == "up"
	}, 30*time.Second, 200*time.Millisecond, "the set's cold exporter")
	assert.Empty(t, e.upstreamPods(t, "up"), "minReplicas 0: no VM before a lease waits")

	// 2. A lease from zero: a VM boots, its exporter registers, the lease
	// is served.
	t0 := js.createLease(t, e.ns, "u1", map[string]string{"board": "qemu-up"})
	l1 := js.waitLease(t, e.ns, "u1", 2*vmBoot, "Ready with an exporter", leaseReady)
	t.Logf("lease u1 -> exporterRef %s from zero through the upstream API in %s", leaseExporter(l1), time.Since(t0).Round(time.Millisecond))
	exp := leaseExporter(l1)
	pod, err := e.c.Client().CoreV1().Pods(e.ns).Get(ctx, exp, metav1.GetOptions{})
	require.NoError(t, err, "the exporter is the pod's")
	assert.Equal(t, "up", pod.Labels[controller.UpstreamExporterSetLabel])
	assert.Empty(t, pod.Spec.SchedulingGates, "the gate is gone once the credential Secret exists")
	assert.Equal(t, "exporter-config-"+exp, pod.Annotations[v1alpha1.JumpstarterSecretAnnotation])
	sec, err := e.c.Client().CoreV1().Secrets(e.ns).Get(ctx, "exporter-config-"+exp, metav1.GetOptions{})
	require.NoError(t, err)
	assert.Equal(t, "up", sec.Labels[controller.UpstreamExporterSetLabel])
	assert.Equal(t, "256Mi", ptr.To(pod.Spec.Containers[0].Resources.Limits[corev1.ResourceMemory]).String(), "the Qemu driver's mem")
	st, ok := js.ctl.ExporterState(e.ns, exp)
	require.True(t, ok)
	assert.True(t, st.Online, "the VM's exporter is Online")
	e.driveVM(t, js, "u1")
	e.waitUpstream(t, "up", time.Minute, "leased 1, exporter active", func(s vtv1.ExporterSetStatus) bool {
		return s.LeasedReplicas == 1 && s.ExportersActive == 1
	})

	// 3. minReplicas 1, then the release: the used VM goes (ExitAndReplace)
	// and a fresh one replaces it.
	require.NoError(t, e.cl.Patch(ctx, &vtv1.ExporterSet{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "up"}},
		client.RawPatch(types.MergePatchType, []byte(`{"spec":{"minReplicas":1}}`))))
	js.release(t, e.ns, "u1")
	js.waitLease(t, e.ns, "u1", 30*time.Second, "ended", leaseEnded)
	e.waitVMGone(t, *pod, 2*time.Minute)
	var fresh corev1.Pod
	require.Eventually(t, func() bool {
		ps := e.upstreamPods(t, "up")
		if len(ps) != 1 || ps[0].Name == exp {
			return false
		}
		fresh = ps[0]
		st, ok := js.ctl.ExporterState(e.ns, fresh.Name)
		return ok && st.Online
	}, 2*vmBoot, time.Second, "a fresh VM replaces the used one, its exporter Online")
	_, err = e.c.Client().CoreV1().Secrets(e.ns).Get(ctx, "exporter-config-"+exp, metav1.GetOptions{})
	assert.True(t, apierrors.IsNotFound(err), "the used VM's Secret went with its pod: %v", err)

	// 4. The other provisioner's set: never written, no pod, no event.
	require.NoError(t, e.cl.Get(ctx, client.ObjectKeyFromObject(other), other))
	assert.Equal(t, otherRV, other.ResourceVersion, "qemu.jumpstarter.dev's set is never written")
	assert.Empty(t, other.Status.Conditions)
	assert.Empty(t, e.upstreamPods(t, "other"))
	evs, err := e.c.Client().CoreV1().Events(e.ns).List(ctx, metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("involvedObject.name", "other").String()})
	require.NoError(t, err)
	assert.Empty(t, evs.Items, "no event about the other provisioner's set")
	evs, err = e.c.Client().CoreV1().Events(e.ns).List(ctx, metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("involvedObject.name", "up").String()})
	require.NoError(t, err)
	assert.NotEmpty(t, evs.Items, "the set's events are written (core events: the Role's)")

	// 5. Upstream's Role was enough.
	b, err := os.ReadFile(logPath)
	require.NoError(t, err)
	for _, line := range strings.Split(string(b), "\n") {
		assert.NotContains(t, strings.ToLower(line), "forbidden", "the provisioner under upstream's Role")
	}
}

// upstreamPods are the live pods of the upstream set name.
func (e *exsEnv) upstreamPods(t *testing.T, name string) []corev1.Pod {
	t.Helper()
	l, err := e.c.Client().CoreV1().Pods(e.ns).List(context.Background(), metav1.ListOptions{LabelSelector: controller.UpstreamLabel + "=" + name})
	require.NoError(t, err)
	var out []corev1.Pod
	for _, p := range l.Items {
		if p.DeletionTimestamp == nil {
			out = append(out, p)
		}
	}
	return out
}

// waitUpstream waits until the upstream set's status satisfies ok.
func (e *exsEnv) waitUpstream(t *testing.T, name string, timeout time.Duration, what string, ok func(vtv1.ExporterSetStatus) bool) {
	t.Helper()
	var s vtv1.ExporterSet
	deadline := time.Now().Add(timeout)
	for e.cl.Get(context.Background(), types.NamespacedName{Namespace: e.ns, Name: name}, &s) != nil || !ok(s.Status) {
		if time.Now().After(deadline) {
			t.Fatalf("exporterset %s: %s: timeout after %s; status %+v", name, what, timeout, s.Status)
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// deleteUpstreamSet deletes the upstream set and waits until its VMs
// stopped.
func (e *exsEnv) deleteUpstreamSet(t *testing.T, name string) {
	ps := e.upstreamPods(t, name)
	err := e.cl.Delete(context.Background(), &vtv1.ExporterSet{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name}},
		client.PropagationPolicy(metav1.DeletePropagationForeground))
	if err != nil && !apierrors.IsNotFound(err) {
		t.Errorf("delete exporterset %s: %v", name, err)
	}
	for _, p := range ps {
		e.waitVMGone(t, p, 90*time.Second)
	}
}
