package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/intstr"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/e2e/cluster"
	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/jstest"
	"github.com/qemu-kubelet/qemu-kubelet/oci/ocitest"
	"github.com/qemu-kubelet/qemu-kubelet/provider/vmtest"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
)

// TestChartAgentUpgradeKeepsVMs runs the node agent as the chart deploys
// it: `helm template`'s DaemonSet pod spec (securityContext, hostPID, host
// network, volumes and mounts, env, args) turned into a runc bundle of the
// image `make image` builds, against the test control plane, with the
// chart's ServiceAccount and RBAC (in-cluster credentials as the kubelet
// mounts them). Two VM pods run, one a Jumpstarter exporter leased to a
// client with a console session open. Then, as `helm upgrade` with a
// changed node configuration and another image does: the old container is
// terminated and deleted (runc delete --force ends every process of its
// cgroup, as containerd does for a hostPID container) and a container of
// the new pod spec and image starts. Checked: the same QEMU processes run
// (same PIDs), the pods stay Ready, the lease is still held, the exporter
// comes back Online and its console answers, `kubectl logs` reads the
// console; the time until all of that is logged. Then deleting a pod stops
// its VM, and removing the DaemonSet (the chart uninstalled) makes the
// terminating agent stop the remaining VM. Run by make e2e-keepvms
// (QK_E2E_KEEPVMS=1), not make test.
func TestChartAgentUpgradeKeepsVMs(t *testing.T) {
	testutil.SkipIfShort(t, "buildah, runc, helm, a control plane and QEMU")
	if os.Getenv("QK_E2E_KEEPVMS") == "" {
		t.Skip("its own target, not in make test (two image builds, minutes): make e2e-keepvms")
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root: buildah's store, runc and cgroups")
	}
	for _, tool := range []string{"buildah", "runc", "debootstrap", "umoci"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s not installed (hack/install-deps.sh installs it): %v", tool, err)
		}
	}
	root := ocitest.RepoRoot(t)
	tmp := t.TempDir()
	ctx := context.Background()

	// Two images (two versions: other binaries, another tag), each unpacked.
	rootfsA, envA := buildUnpackedImage(t, root, tmp, "v0.1.0-e2e-keep-a")
	rootfsB, envB := buildUnpackedImage(t, root, tmp, "v0.1.0-e2e-keep-b")
	helm := buildHelmBin(t, root)

	c := cluster.StartT(t, cluster.Options{})
	reg := ocitest.StartRegistry(t, ocitest.RegistryOptions{})
	refs := vmtest.PushTestImages(t, reg.Addr)
	const ns = "qk-system"
	if _, err := c.Kubectl(ctx, "create", "namespace", ns); err != nil {
		t.Fatal(err)
	}

	// The chart, as a user installs it on a host without /dev/kvm.
	hostNode := "kvm-host-1"
	ip, port := testutil.HostIPv4(t), testutil.FreePort(t)
	// Short: unix socket paths under it are limited to 107 bytes.
	state, err := os.MkdirTemp("/tmp", "qk-keep-")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(state) })
	cgParent := fmt.Sprintf("qk-e2e-%d", os.Getpid())
	values := func(statusFreq string) []string {
		return []string{
			"controller.enabled=false", "runtimeClass.create=false",
			"nodeAgent.kvm.mode=none", "nodeAgent.hostNetwork=true",
			"nodeAgent.stateDir=" + state, "nodeAgent.keepVMs.cgroupParent=" + cgParent,
			"nodeAgent.config.nodeIP=" + ip, "nodeAgent.config.server.address=" + ip,
			fmt.Sprintf("nodeAgent.config.server.port=%d", port),
			"nodeAgent.config.accelerator.policy=tcg", "nodeAgent.config.maxVMs=4",
			"nodeAgent.config.nodeStatusUpdateFrequency=" + statusFreq, "nodeAgent.config.nodeLeaseDurationSeconds=12",
			"nodeAgent.logVerbosity=2",
		}
	}
	t.Cleanup(func() {
		if dirs, err := filepath.Glob(filepath.Join("/sys/fs/cgroup", "*", cgParent)); err == nil {
			for _, d := range dirs {
				_ = syscall.Rmdir(d)
			}
		}
	})
	render := func(tag, statusFreq string) (objs []unstructured.Unstructured, ds *appsv1.DaemonSet, configYAML string) {
		args := []string{"template", "qk", filepath.Join(root, "charts", "qemu-kubelet"), "--namespace", ns, "--set", "image.tag=" + tag}
		for _, v := range values(statusFreq) {
			args = append(args, "--set", v)
		}
		cmd := exec.Command(helm, args...)
		home := t.TempDir()
		cmd.Env = append(os.Environ(), "HELM_CACHE_HOME="+home+"/c", "HELM_CONFIG_HOME="+home+"/f", "HELM_DATA_HOME="+home+"/d")
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("helm template: %v\n%s", err, stderr.String())
		}
		dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(out), 4096)
		for {
			var u unstructured.Unstructured
			if err := dec.Decode(&u.Object); err != nil {
				break
			}
			if len(u.Object) == 0 {
				continue
			}
			objs = append(objs, u)
			switch u.GetKind() {
			case "DaemonSet":
				ds = &appsv1.DaemonSet{}
				b, _ := json.Marshal(u.Object)
				require.NoError(t, json.Unmarshal(b, ds))
			case "ConfigMap":
				var cm corev1.ConfigMap
				b, _ := json.Marshal(u.Object)
				require.NoError(t, json.Unmarshal(b, &cm))
				configYAML = cm.Data["config.yaml"]
			}
		}
		require.NotNil(t, ds, "the chart renders no DaemonSet")
		require.NotEmpty(t, configYAML, "the chart renders no node configuration")
		return objs, ds, configYAML
	}
	apply := func(objs []unstructured.Unstructured) {
		var buf bytes.Buffer
		for _, o := range objs {
			b, _ := yaml.Marshal(o.Object)
			buf.WriteString("---\n")
			buf.Write(b)
		}
		p := filepath.Join(t.TempDir(), "chart.yaml")
		require.NoError(t, os.WriteFile(p, buf.Bytes(), 0o600))
		if out, err := c.Kubectl(ctx, "apply", "--server-side", "--force-conflicts", "-f", p); err != nil {
			t.Fatalf("apply the rendered chart: %v\n%s", err, out)
		}
	}

	objsA, dsA, cfgA := render("keep-a", "2s")
	pod := dsA.Spec.Template.Spec
	if !pod.HostPID {
		t.Fatal("the chart's agent pod has no hostPID: VMs cannot outlive its container")
	}
	apply(objsA)
	rt := &runcEnv{t: t, root: filepath.Join(tmp, "runc")}
	agentA := startChartAgent(t, c, rt, ns, dsA, cfgA, rootfsA, envA, hostNode, "a")
	node := "qemu-" + hostNode
	waitNode(t, c, node, 3*time.Minute, "Ready", readyIs("True"))

	// Jumpstarter: the controller and router double, an exporter Secret.
	ctrl, err := jstest.Start(jstest.Options{DialWait: 60 * time.Second})
	require.NoError(t, err)
	t.Cleanup(ctrl.Close)
	const jsNS, exporter = "lab", "keep-board"
	token := ctrl.AddExporter(jsNS, exporter, "")
	caFile := filepath.Join(t.TempDir(), "ca.crt")
	require.NoError(t, os.WriteFile(caFile, ctrl.CABundle(), 0o600))
	_, err = c.Kubectl(ctx, "create", "secret", "generic", "js-keep", "-n", "default", "--from-literal=endpoint="+ctrl.Endpoint(),
		"--from-literal=token="+token, "--from-literal=namespace="+jsNS, "--from-literal=name="+exporter, "--from-file=ca.crt="+caFile)
	require.NoError(t, err)

	board := vmPodSpec("keep-board", node, refs[vmtest.VariantACPI], corev1.RestartPolicyAlways, map[string]string{v1alpha1.JumpstarterSecretAnnotation: "js-keep"})
	board.Labels = map[string]string{"jumpstarter.dev/board": "keep"}
	board.Spec.Containers[0].Ports = []corev1.ContainerPort{{Name: "http", ContainerPort: 8080}}
	board.Spec.Containers[0].ReadinessProbe = &corev1.Probe{ProbeHandler: corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/", Port: intstr.FromString("http")}}, PeriodSeconds: 1}
	board.Spec.Volumes = []corev1.Volume{{Name: "jumpstarter-credentials", VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{SecretName: "js-keep"}}}}
	plain := vmPodSpec("keep-plain", node, refs[vmtest.VariantACPI], corev1.RestartPolicyAlways, nil)
	plain.Spec.Containers[0].Ports = []corev1.ContainerPort{{Name: "http", ContainerPort: 8080}}
	plain.Spec.Containers[0].ReadinessProbe = board.Spec.Containers[0].ReadinessProbe.DeepCopy()
	grace := int64(10)
	board.Spec.TerminationGracePeriodSeconds, plain.Spec.TerminationGracePeriodSeconds = &grace, &grace
	for _, p := range []*corev1.Pod{board, plain} {
		_, err := c.Client().CoreV1().Pods("default").Create(ctx, p, metav1.CreateOptions{})
		require.NoError(t, err)
	}
	t.Cleanup(func() {
		_ = c.Client().CoreV1().Pods("default").DeleteCollection(context.Background(), metav1.DeleteOptions{}, metav1.ListOptions{})
		if !waitFor(2*time.Minute, 500*time.Millisecond, func() bool { return len(vmtest.QEMUPids(state)) == 0 }) {
			for _, pid := range vmtest.QEMUPids(state) {
				_ = syscall.Kill(pid, syscall.SIGKILL)
			}
		}
	})
	ready := func(p *corev1.Pod) bool { return podReady(p) }
	bp := waitPod(t, c, "default", "keep-board", 6*time.Minute, "Ready with the exporter Online", func(p *corev1.Pod) bool { return ready(p) && jsOnline(p) })
	pp := waitPod(t, c, "default", "keep-plain", 6*time.Minute, "Ready", ready)

	pidOf := func(uid string) int {
		b, err := os.ReadFile(filepath.Join(state, "vms", uid, qemu.PidfileName))
		require.NoError(t, err)
		var pid int
		fmt.Sscanf(string(b), "%d", &pid)
		return pid
	}
	pids := map[string]int{"keep-board": pidOf(string(bp.UID)), "keep-plain": pidOf(string(pp.UID))}
	for name, pid := range pids {
		// Unprivileged and sandboxed, whatever the agent holds.
		status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
		require.NoError(t, err)
		// As the chart's vmUser (KubeVirt's qemu uid), from its first instruction.
		for _, want := range []string{"Uid:\t107\t107\t107\t107", "Gid:\t107\t107\t107\t107",
			"CapEff:\t0000000000000000", "CapPrm:\t0000000000000000", "CapBnd:\t0000000000000000", "NoNewPrivs:\t1", "Seccomp:\t2"} {
			if !strings.Contains(string(status), want+"\n") {
				t.Errorf("%s: no %q in QEMU's /proc/%d/status", name, want, pid)
			}
		}
		cg, err := qemu.CgroupOf(pid, "memory")
		require.NoError(t, err)
		if want := "/" + cgParent + "/"; !strings.HasPrefix(cg, want) {
			t.Errorf("%s: QEMU %d in memory cgroup %q, want one under %s", name, pid, cg, want)
		}
	}

	// The lease and a session with the console.
	require.NoError(t, ctrl.AssignLease(jsNS, "lease-keep", exporter, "ci"))
	cl := ctrl.NewClient(jsNS, "ci")
	consoleEcho := func(ctx context.Context, word string) error {
		s, err := cl.Dial(ctx, "lease-keep")
		if err != nil {
			return err
		}
		defer s.Close()
		rep, err := s.GetReport(ctx)
		if err != nil {
			return err
		}
		d, ok := jstest.FindDriver(rep, "console")
		if !ok {
			return fmt.Errorf("no console driver in the report")
		}
		con, err := s.Stream(ctx, d.GetUuid(), "connect")
		if err != nil {
			return err
		}
		defer con.Close()
		if _, err := con.Write([]byte(word + "\n")); err != nil {
			return err
		}
		return readUntilCtx(ctx, con, "QK-ECHO: "+word)
	}
	cctx, ccancel := context.WithTimeout(ctx, 2*time.Minute)
	require.NoError(t, consoleEcho(cctx, "before-upgrade"))
	ccancel()

	// `helm upgrade`: another node configuration and another image. The
	// old pod goes (its container killed and deleted: every process of its
	// cgroup ends), the DaemonSet's new pod starts.
	objsB, dsB, cfgB := render("keep-b", "3s")
	if dsA.Spec.Template.Annotations["checksum/config"] == dsB.Spec.Template.Annotations["checksum/config"] {
		t.Fatal("the changed node configuration does not change the pod template's checksum: no roll")
	}
	apply(objsB)
	upgradeStart := time.Now()
	// The kubelet's termination: SIGTERM (the agent sees its DaemonSet
	// and keeps the VMs), then the container is deleted.
	rt.terminate(agentA, 30*time.Second)
	if pid := rt.pid(agentA); pid != 0 {
		t.Fatalf("the old agent container still runs (pid %d)", pid)
	}
	for name, pid := range pids {
		if !processAlive(pid) {
			t.Fatalf("%s: QEMU %d died with the agent's container", name, pid)
		}
	}
	startChartAgent(t, c, rt, ns, dsB, cfgB, rootfsB, envB, hostNode, "b")
	var backAt = map[string]time.Duration{}
	mark := func(what string) { backAt[what] = time.Since(upgradeStart).Round(10 * time.Millisecond) }
	// The node reports the new version (the new image's agent).
	waitNode(t, c, node, 3*time.Minute, "the new agent's version", func(n *corev1.Node) bool {
		return n.Status.NodeInfo.KubeletVersion == "v0.1.0-e2e-keep-b" && readyIs("True")(n)
	})
	mark("node Ready (new agent)")
	cctx, ccancel = context.WithTimeout(ctx, 3*time.Minute)
	defer ccancel()
	if _, err := ctrl.WaitExporter(cctx, jsNS, exporter, func(s jstest.ExporterState) bool { return s.Online && s.Registrations >= 2 }); err != nil {
		t.Fatalf("the exporter never came back Online: %v", err)
	}
	mark("exporter Online")
	require.NoError(t, consoleEcho(cctx, "after-upgrade"), "console through the lease after the upgrade")
	mark("Jumpstarter console")
	if !waitFor(2*time.Minute, 200*time.Millisecond, func() bool {
		out, err := c.Kubectl(ctx, "logs", "keep-plain")
		return err == nil && strings.Contains(out, vmtest.BootMarker)
	}) {
		t.Fatal("kubectl logs never read the plain VM's console after the upgrade")
	}
	mark("kubectl logs")
	for _, name := range []string{"keep-board", "keep-plain"} {
		waitPod(t, c, "default", name, 2*time.Minute, "Ready after the upgrade", ready)
	}
	mark("pods Ready")
	for name, pid := range pids {
		p, err := c.Client().CoreV1().Pods("default").Get(ctx, name, metav1.GetOptions{})
		require.NoError(t, err)
		if got := pidOf(string(p.UID)); got != pid || !processAlive(pid) {
			t.Errorf("%s: QEMU pid %d after the upgrade (alive %v), want the same %d", name, got, processAlive(pid), pid)
		}
		if cs := p.Status.ContainerStatuses; len(cs) != 1 || cs[0].RestartCount != 0 {
			t.Errorf("%s: container statuses after the upgrade %+v, want no restart", name, cs)
		}
	}
	if st, ok := ctrl.ExporterState(jsNS, exporter); !ok || !st.Online {
		t.Errorf("exporter state after the upgrade: %+v", st)
	}
	if err := ctrl.AssignLease(jsNS, "lease-other", exporter, "other"); err == nil {
		t.Error("another lease was granted on the exporter: lease-keep is no longer held")
	}
	keys := make([]string, 0, len(backAt))
	for k := range backAt {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool { return backAt[keys[i]] < backAt[keys[j]] })
	var sum []string
	for _, k := range keys {
		sum = append(sum, fmt.Sprintf("%s %s", k, backAt[k]))
	}
	t.Logf("upgrade kept %d VMs (same PIDs %v); back after the old container's kill: %s", len(pids), pids, strings.Join(sum, ", "))

	// Deleting a pod stops its VM and removes its cgroup.
	require.NoError(t, c.Client().CoreV1().Pods("default").Delete(ctx, "keep-plain", metav1.DeleteOptions{}))
	if !waitFor(90*time.Second, 200*time.Millisecond, func() bool { return !processAlive(pids["keep-plain"]) }) {
		t.Fatalf("QEMU %d still runs after its pod was deleted", pids["keep-plain"])
	}

	// helm uninstall: the DaemonSet goes, then its pod's agent is told to
	// terminate: it stops the VMs no agent will come back for.
	if out, err := c.Kubectl(ctx, "delete", "daemonset", "-n", ns, dsB.Name, "--wait=true"); err != nil {
		t.Fatalf("delete the DaemonSet: %v\n%s", err, out)
	}
	rt.terminate(rt.ids["b"], 40*time.Second)
	if !waitFor(30*time.Second, 200*time.Millisecond, func() bool { return !processAlive(pids["keep-board"]) }) {
		t.Fatalf("QEMU %d still runs after the chart was uninstalled and its agent terminated", pids["keep-board"])
	}
	if left, _ := filepath.Glob(filepath.Join("/sys/fs/cgroup", "*", cgParent, "*")); len(dirsOnly(left)) > 0 {
		t.Errorf("VM cgroups left after every VM stopped: %v", dirsOnly(left))
	}
}

func dirsOnly(paths []string) []string {
	var out []string
	for _, p := range paths {
		if fi, err := os.Stat(p); err == nil && fi.IsDir() {
			out = append(out, p)
		}
	}
	return out
}

func processAlive(pid int) bool {
	st, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	i := bytes.LastIndexByte(st, ')')
	return i > 0 && len(st) > i+2 && st[i+2] != 'Z' && st[i+2] != 'X'
}

// buildUnpackedImage runs `make image` for version and unpacks it; it
// returns the root fs and the image's environment.
func buildUnpackedImage(t *testing.T, root, tmp, version string) (string, []string) {
	t.Helper()
	bin := filepath.Join(tmp, "bin-"+version)
	start := time.Now()
	cmd := exec.Command("make", "-s", "image", "BIN="+bin, "VERSION="+version)
	cmd.Dir = root
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("make image: %v\n%s", err, tail(stderr.String(), 40))
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	ref := lines[len(lines)-1]
	layout, tag, ok := strings.Cut(strings.TrimPrefix(ref, "oci:"), ":")
	if !ok {
		t.Fatalf("make image printed %q", ref)
	}
	rootfs := filepath.Join(tmp, "rootfs-"+version)
	if b, err := exec.Command("umoci", "raw", "unpack", "--image", layout+":"+tag, rootfs).CombinedOutput(); err != nil {
		t.Fatalf("umoci raw unpack: %v\n%s", err, b)
	}
	t.Logf("image %s built and unpacked in %s", ref, time.Since(start).Round(time.Second))
	return rootfs, readLayoutImage(t, layout, tag).Config.Env
}

func buildHelmBin(t *testing.T, root string) string {
	t.Helper()
	cmd := exec.Command(filepath.Join(root, "hack", "build-helm.sh"))
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("hack/build-helm.sh: %v\n%s", err, stderr.String())
	}
	return strings.TrimSpace(string(out))
}

var envRefRE = regexp.MustCompile(`\$\(([A-Za-z_][A-Za-z0-9_]*)\)`)

// startChartAgent creates the DaemonSet's pod (as the DaemonSet
// controller would: its template, owned by it, for host hostNode) and runs
// its container with runc as a kubelet would: the pod spec's command and
// args ($(VAR) expanded), env (downward API resolved), securityContext,
// hostPID and hostNetwork, volumes (hostPath bound, the ConfigMap's files,
// emptyDir as tmpfs) and the ServiceAccount's token, CA and namespace with
// the in-cluster API address.
func startChartAgent(t *testing.T, c *cluster.Cluster, rt *runcEnv, ns string, ds *appsv1.DaemonSet, configYAML, rootfs string, imageEnv []string, hostNode, name string) string {
	t.Helper()
	ctx := context.Background()
	tpl := ds.Spec.Template
	live, err := c.Client().AppsV1().DaemonSets(ns).Get(ctx, ds.Name, metav1.GetOptions{})
	require.NoError(t, err)
	yes := true
	podObj := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: ds.Name + "-" + name, Namespace: ns, Labels: tpl.Labels, Annotations: tpl.Annotations,
			OwnerReferences: []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "DaemonSet", Name: live.Name, UID: live.UID, Controller: &yes, BlockOwnerDeletion: &yes}}},
		Spec: *tpl.Spec.DeepCopy(),
	}
	// Never scheduled (no real node runs it): the container below is it.
	podObj.Spec.NodeSelector = map[string]string{"qemu-kubelet.io/e2e-no-such-node": "true"}
	p, err := c.Client().CoreV1().Pods(ns).Create(ctx, podObj, metav1.CreateOptions{})
	require.NoError(t, err)
	spec := p.Spec
	ctr := spec.Containers[0]

	// In-cluster credentials, as the kubelet projects them.
	sa := filepath.Join(t.TempDir(), "sa")
	require.NoError(t, os.MkdirAll(sa, 0o755))
	tok, err := c.Kubectl(ctx, "create", "token", spec.ServiceAccountName, "-n", ns, "--duration=2h")
	require.NoError(t, err, tok)
	copyFile(t, c.CAFile(), filepath.Join(sa, "ca.crt"), 0, 0)
	writeFile(t, filepath.Join(sa, "token"), strings.TrimSpace(tok))
	writeFile(t, filepath.Join(sa, "namespace"), ns)
	apiPort := strings.TrimPrefix(c.ServerURL(), "https://127.0.0.1:")

	env := map[string]string{"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": apiPort}
	var envList []string
	envList = append(envList, imageEnv...)
	for _, e := range ctr.Env {
		v := e.Value
		if f := e.ValueFrom; f != nil && f.FieldRef != nil {
			switch f.FieldRef.FieldPath {
			case "spec.nodeName":
				v = hostNode
			case "metadata.name":
				v = p.Name
			case "metadata.namespace":
				v = p.Namespace
			default:
				t.Fatalf("env %s: field %s not resolved by this test", e.Name, f.FieldRef.FieldPath)
			}
		}
		env[e.Name] = v
	}
	for k, v := range env {
		envList = append(envList, k+"="+v)
	}
	expand := func(s string) string {
		return envRefRE.ReplaceAllStringFunc(s, func(m string) string {
			if v, ok := env[m[2:len(m)-1]]; ok {
				return v
			}
			return m
		})
	}
	var args []string
	for _, a := range append(append([]string{}, ctr.Command...), ctr.Args...) {
		args = append(args, expand(a))
	}

	var binds []bind
	var tmpfs []string
	saMounted := false
	for _, m := range ctr.VolumeMounts {
		var vol *corev1.Volume
		for i := range spec.Volumes {
			if spec.Volumes[i].Name == m.Name {
				vol = &spec.Volumes[i]
			}
		}
		require.NotNil(t, vol, "volume %s", m.Name)
		switch {
		case vol.HostPath != nil:
			if vol.HostPath.Type != nil && *vol.HostPath.Type == corev1.HostPathDirectoryOrCreate {
				require.NoError(t, os.MkdirAll(vol.HostPath.Path, 0o755))
			}
			binds = append(binds, bind{src: vol.HostPath.Path, dst: m.MountPath, ro: m.ReadOnly})
		case vol.ConfigMap != nil:
			d := filepath.Join(t.TempDir(), "cm")
			require.NoError(t, os.MkdirAll(d, 0o755))
			writeFile(t, filepath.Join(d, "config.yaml"), configYAML)
			binds = append(binds, bind{src: d, dst: m.MountPath, ro: true})
		case vol.EmptyDir != nil:
			tmpfs = append(tmpfs, m.MountPath)
		case vol.Projected != nil && strings.HasPrefix(vol.Name, "kube-api-access-"):
			// The ServiceAccount admission plugin's token volume: token,
			// ca.crt and namespace.
			binds = append(binds, bind{src: sa, dst: m.MountPath, ro: true})
			saMounted = true
		default:
			t.Fatalf("volume %s: kind not handled by this test", m.Name)
		}
	}
	require.True(t, saMounted, "the pod has no ServiceAccount token volume")
	sc := ctr.SecurityContext
	require.NotNil(t, sc, "the agent container has no securityContext")
	ps := podSpecContainer{
		args: args, env: envList, binds: binds, tmpfs: tmpfs,
		uid: derefInt64(sc.RunAsUser), gid: derefInt64(sc.RunAsGroup),
		privileged: sc.Privileged != nil && *sc.Privileged, noNewPrivs: sc.AllowPrivilegeEscalation != nil && !*sc.AllowPrivilegeEscalation,
		readOnlyRoot: sc.ReadOnlyRootFilesystem != nil && *sc.ReadOnlyRootFilesystem,
		hostPID:      spec.HostPID, hostNetwork: spec.HostNetwork,
	}
	if sc.Capabilities != nil {
		for _, c := range sc.Capabilities.Add {
			ps.addCaps = append(ps.addCaps, "CAP_"+string(c))
		}
		for _, c := range sc.Capabilities.Drop {
			ps.dropAll = ps.dropAll || c == "ALL"
		}
	}
	id := rt.runPod(name, rootfs, ps)
	t.Cleanup(func() {
		_ = c.Client().CoreV1().Pods(ns).Delete(context.Background(), p.Name, metav1.DeleteOptions{})
	})
	return id
}

func derefInt64(p *int64) int64 {
	if p == nil {
		return 0
	}
	return *p
}
