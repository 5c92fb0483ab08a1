package e2e

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/qemu-kubelet/qemu-kubelet/e2e/cluster"
	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	"github.com/qemu-kubelet/qemu-kubelet/oci/ocitest"
	"github.com/qemu-kubelet/qemu-kubelet/provider/vmtest"
)

// TestImage builds the Dockerfile's image with `make image` (buildah from a
// debootstrap base: no Docker engine, no container registry), runs the node
// agent and the controller from it with runc against a test control plane,
// and boots a VM pod of an ExporterSet through the agent in the container:
// the controller in its container creates the pod, the agent in its
// container boots it, the pod gets Ready and `kubectl logs` shows the guest's
// boot marker. QEMU in the container runs as it does outside: no
// capabilities, no_new_privs, its own seccomp sandbox.
func TestImage(t *testing.T) {
	testutil.SkipIfShort(t, "buildah, runc, a control plane and QEMU")
	if os.Geteuid() != 0 {
		t.Skip("needs root: buildah's store, debootstrap and runc (rootful) run as root")
	}
	for _, tool := range []string{"buildah", "runc", "debootstrap", "umoci"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s not installed (hack/install-deps.sh installs it): %v", tool, err)
		}
	}
	root := ocitest.RepoRoot(t)
	tmp := t.TempDir()

	// make image, as a user runs it (cached by content: a rebuild with the
	// same sources and version reuses the image).
	bin := filepath.Join(tmp, "bin")
	start := time.Now()
	cmd := exec.Command("make", "-s", "image", "BIN="+bin, "VERSION=v0.1.0-e2e")
	cmd.Dir = root
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("make image: %v\n%s", err, tail(stderr.String(), 40))
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	ref := lines[len(lines)-1]
	t.Logf("make image: %s in %s", ref, time.Since(start).Round(time.Second))
	layout, tag, ok := strings.Cut(strings.TrimPrefix(ref, "oci:"), ":")
	if !strings.HasPrefix(ref, "oci:") || !ok {
		t.Fatalf("make image printed %q, want oci:DIR:TAG", ref)
	}

	// The image's config is the Dockerfile's: the controller by default, as
	// the non-root user.
	img := readLayoutImage(t, layout, tag)
	if got := strings.Join(img.Config.Entrypoint, " "); got != "/usr/local/bin/exporterset-controller" {
		t.Errorf("image entrypoint %q", got)
	}
	if img.Config.User != "65532:65532" {
		t.Errorf("image user %q, want 65532:65532", img.Config.User)
	}

	// One read-only root fs for both containers.
	rootfs := filepath.Join(tmp, "rootfs")
	start = time.Now()
	if b, err := exec.Command("umoci", "raw", "unpack", "--image", layout+":"+tag, rootfs).CombinedOutput(); err != nil {
		t.Fatalf("umoci raw unpack: %v\n%s", err, b)
	}
	t.Logf("unpacked in %s", time.Since(start).Round(time.Second))
	for _, b := range []string{"qemu-kubelet", "exporterset-controller"} {
		if fileSHA(t, filepath.Join(rootfs, "usr/local/bin", b)) != fileSHA(t, filepath.Join(bin, b)) {
			t.Errorf("/usr/local/bin/%s in the image is not the one make build wrote", b)
		}
	}
	for _, tool := range []string{"usr/bin/qemu-system-x86_64", "usr/bin/qemu-img", "usr/sbin/mkfs.vfat", "usr/bin/mcopy"} {
		if _, err := os.Stat(filepath.Join(rootfs, tool)); err != nil {
			t.Errorf("the image lacks /%s: %v", tool, err)
		}
	}

	c := cluster.StartT(t, cluster.Options{})
	reg := ocitest.StartRegistry(t, ocitest.RegistryOptions{})
	refs := vmtest.PushTestImages(t, reg.Addr)
	ctx := context.Background()
	if _, err := c.Kubectl(ctx, "apply", "--server-side", "-f", filepath.Join(root, "config", "crd")); err != nil {
		t.Fatal(err)
	}
	if err := wait.PollUntilContextTimeout(ctx, 300*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		_, err := c.Kubectl(ctx, "get", "exportersets")
		return err == nil, nil
	}); err != nil {
		t.Fatalf("ExporterSet CRD never served: %v", err)
	}
	rt := &runcEnv{t: t, root: filepath.Join(tmp, "runc"), rootfs: rootfs}

	// The node agent: root without capabilities, no_new_privs, read-only
	// root fs, host network (the API server reaches its kubelet API on the
	// host's address), the state dir and /dev/kvm (if any) from the host,
	// its configuration read-only: the chart's unprivileged mode.
	node := "qk-image"
	ip, port := testutil.HostIPv4(t), testutil.FreePort(t)
	state := filepath.Join(tmp, "state") // same path inside: QEMU's command line names it
	etc := filepath.Join(tmp, "agent-etc")
	for _, d := range []string{state, etc} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	nodeKC, err := c.NodeKubeconfig(node)
	if err != nil {
		t.Fatal(err)
	}
	copyFile(t, nodeKC, filepath.Join(etc, "kubeconfig"), 0, 0)
	copyFile(t, c.CAFile(), filepath.Join(etc, "ca.crt"), 0, 0)
	writeFile(t, filepath.Join(etc, "config.yaml"), fmt.Sprintf(`apiVersion: qemu-kubelet.io/v1alpha1
kind: NodeConfiguration
nodeName: %s
nodeIP: %s
stateDir: %s
maxVMs: 4
reserved: {cpu: 100m, memory: 256Mi, ephemeral-storage: 1Gi}
accelerator: {policy: prefer-kvm, probeTimeout: 20s}
server: {address: %s, port: %d, clientCAFile: /etc/qemu-kubelet/ca.crt}
nodeStatusUpdateFrequency: 2s
nodeLeaseDurationSeconds: 12
# Root without CAP_SETUID cannot start QEMU as the default 107: QEMU runs
# as the agent (the chart's unprivileged modes grant the capabilities).
vmUser: {uid: 0, gid: 0}
`, node, ip, state, ip, port))
	agent := rt.run("agent", containerSpec{
		user: "0:0",
		args: []string{"/usr/local/bin/qemu-kubelet", "--config=/etc/qemu-kubelet/config.yaml", "--kubeconfig=/etc/qemu-kubelet/kubeconfig", "-v=2"},
		env:  img.Config.Env,
		binds: []bind{
			{src: etc, dst: "/etc/qemu-kubelet", ro: true},
			{src: state, dst: state},
		},
		kvm: true,
	})

	// The controller: the image's entrypoint and user (65532), nothing else
	// from the host but a kubeconfig that user can read.
	ctrlEtc := filepath.Join(tmp, "controller-etc")
	if err := os.MkdirAll(ctrlEtc, 0o755); err != nil {
		t.Fatal(err)
	}
	copyFile(t, c.AdminKubeconfig(), filepath.Join(ctrlEtc, "kubeconfig"), 65532, 65532)
	rt.run("controller", containerSpec{
		user: img.Config.User,
		args: append(append([]string{}, img.Config.Entrypoint...), "--kubeconfig=/etc/exporterset-controller/kubeconfig",
			fmt.Sprintf("--metrics-bind-address=127.0.0.1:%d", testutil.FreePort(t)),
			fmt.Sprintf("--health-probe-bind-address=127.0.0.1:%d", testutil.FreePort(t)), "-v=2"),
		env:   img.Config.Env,
		binds: []bind{{src: ctrlEtc, dst: "/etc/exporterset-controller", ro: true}},
	})

	waitNode(t, c, node, 3*time.Minute, "Ready", readyIs("True"))

	set := fmt.Sprintf(`apiVersion: qemu-kubelet.io/v1alpha1
kind: ExporterSet
metadata: {name: image-pool, namespace: default}
spec:
  replicas: 1
  minAvailable: 1
  selector: {matchLabels: {app: image-pool}}
  template:
    metadata: {labels: {app: image-pool}}
    spec:
      nodeSelector: {kubernetes.io/hostname: %s}
      tolerations: [{key: virtual-kubelet.io/provider, operator: Equal, value: qemu, effect: NoSchedule}]
      terminationGracePeriodSeconds: 10
      containers:
      - name: vm
        image: %s
        ports: [{name: http, containerPort: 8080}]
        readinessProbe: {httpGet: {path: /, port: http}, periodSeconds: 1}
        resources:
          requests: {cpu: 100m, memory: 64Mi}
          limits: {cpu: "1", memory: 256Mi}
`, node, refs[vmtest.VariantACPI])
	setPath := filepath.Join(tmp, "set.yaml")
	writeFile(t, setPath, set)
	if _, err := c.Kubectl(ctx, "apply", "-f", setPath); err != nil {
		t.Fatal(err)
	}
	// VMs stop with their pods, before the containers and the cluster go.
	t.Cleanup(func() {
		_, _ = c.Kubectl(context.Background(), "delete", "-f", setPath, "--wait=false")
		_ = c.Client().CoreV1().Pods("default").DeleteCollection(context.Background(), metav1.DeleteOptions{}, metav1.ListOptions{})
		if !waitFor(2*time.Minute, 500*time.Millisecond, func() bool { return len(vmtest.QEMUPids(state)) == 0 }) {
			t.Errorf("QEMU still running after the pods were deleted: %v", vmtest.QEMUPids(state))
		}
	})

	var pod string
	if !waitFor(6*time.Minute, time.Second, func() bool {
		l, err := c.Client().CoreV1().Pods("default").List(ctx, metav1.ListOptions{LabelSelector: "app=image-pool"})
		if err != nil || len(l.Items) != 1 || !podReady(&l.Items[0]) {
			return false
		}
		pod = l.Items[0].Name
		return true
	}) {
		out, _ := c.Kubectl(ctx, "get", "exportersets,pods", "-o", "wide")
		t.Fatalf("the ExporterSet's pod never got Ready:\n%s", out)
	}
	// Ready (the guest's HTTP server answers) comes before the guest's
	// init prints the boot marker (consoleShowsBoot says why): kubectl logs
	// is asked until it shows the marker, for up to markerLag.
	var logs string
	var lerr error
	if !waitFor(markerLag, 500*time.Millisecond, func() bool {
		logs, lerr = c.Kubectl(ctx, "logs", pod)
		return lerr == nil && strings.Contains(logs, vmtest.BootMarker)
	}) {
		t.Fatalf("kubectl logs %s: no %s within %s of the pod's Ready (err %v):\n%s", pod, vmtest.BootMarker, markerLag, lerr, tail(logs, 20))
	}

	// The VM's QEMU runs in the agent's container, unprivileged and
	// sandboxed as outside one.
	pids := vmtest.QEMUPids(state)
	if len(pids) != 1 {
		t.Fatalf("QEMU processes under %s: %v, want 1", state, pids)
	}
	qemuNS, _ := os.Readlink(fmt.Sprintf("/proc/%d/ns/mnt", pids[0]))
	agentNS, _ := os.Readlink(fmt.Sprintf("/proc/%d/ns/mnt", rt.pid(agent)))
	hostNS, _ := os.Readlink("/proc/self/ns/mnt")
	if qemuNS == "" || qemuNS != agentNS || qemuNS == hostNS {
		t.Errorf("QEMU's mount namespace %q: want the agent container's %q, not the host's %q", qemuNS, agentNS, hostNS)
	}
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pids[0]))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"CapEff:\t0000000000000000", "CapPrm:\t0000000000000000", "NoNewPrivs:\t1", "Seccomp:\t2"} {
		if !strings.Contains(string(status), want+"\n") {
			t.Errorf("QEMU in the container: no %q in /proc/%d/status:\n%s", want, pids[0], status)
		}
	}
}

// readLayoutImage returns the image config of tag in the OCI layout dir.
func readLayoutImage(t *testing.T, dir, tag string) ocispec.Image {
	t.Helper()
	blob := func(d ocispec.Descriptor, v any) {
		t.Helper()
		b, err := os.ReadFile(filepath.Join(dir, "blobs", d.Digest.Algorithm().String(), d.Digest.Encoded()))
		if err != nil {
			t.Fatal(err)
		}
		if err := json.Unmarshal(b, v); err != nil {
			t.Fatalf("%s: %v", d.Digest, err)
		}
	}
	var idx ocispec.Index
	b, err := os.ReadFile(filepath.Join(dir, "index.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &idx); err != nil {
		t.Fatal(err)
	}
	for _, m := range idx.Manifests {
		if m.Annotations[ocispec.AnnotationRefName] != tag {
			continue
		}
		var man ocispec.Manifest
		blob(m, &man)
		var img ocispec.Image
		blob(man.Config, &img)
		return img
	}
	t.Fatalf("%s: no image tagged %q", dir, tag)
	return ocispec.Image{}
}

func fileSHA(t *testing.T, path string) [32]byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return sha256.Sum256(b)
}

func copyFile(t *testing.T, src, dst string, uid, gid int) {
	t.Helper()
	b, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	writeFile(t, dst, string(b))
	if err := os.Chown(dst, uid, gid); err != nil {
		t.Fatal(err)
	}
}

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
}

// runcEnv runs containers from one unpacked root fs with runc, its state
// under root. Each container is killed and deleted when the test ends.
type runcEnv struct {
	t      *testing.T
	root   string
	rootfs string
	// ids: containers started by runPod, by name.
	ids map[string]string
}

type bind struct {
	src, dst string
	ro       bool
}

// containerSpec is what differs between the two containers.
type containerSpec struct {
	user  string // uid:gid
	args  []string
	env   []string
	binds []bind
	kvm   bool // pass /dev/kvm through if the host has it
}

// run starts container name in the foreground of a `runc run` child
// (output to a log in the test dir) and returns its id.
func (r *runcEnv) run(name string, s containerSpec) string {
	t := r.t
	t.Helper()
	bundle := filepath.Join(filepath.Dir(r.rootfs), "bundle-"+name)
	if err := os.MkdirAll(bundle, 0o700); err != nil {
		t.Fatal(err)
	}
	if b, err := exec.Command("runc", "spec", "--bundle", bundle).CombinedOutput(); err != nil {
		t.Fatalf("runc spec: %v\n%s", err, b)
	}
	var cfg map[string]any
	b, err := os.ReadFile(filepath.Join(bundle, "config.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &cfg); err != nil {
		t.Fatal(err)
	}
	var uid, gid int
	if _, err := fmt.Sscanf(s.user, "%d:%d", &uid, &gid); err != nil {
		t.Fatalf("user %q: %v", s.user, err)
	}
	proc := cfg["process"].(map[string]any)
	proc["terminal"] = false
	proc["args"] = s.args
	proc["env"] = s.env
	proc["user"] = map[string]any{"uid": uid, "gid": gid}
	proc["noNewPrivileges"] = true
	proc["capabilities"] = map[string]any{} // none at all
	// The host's open-files limit (raising it needs CAP_SYS_RESOURCE).
	var nofile syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &nofile); err != nil {
		t.Fatal(err)
	}
	proc["rlimits"] = []any{map[string]any{"type": "RLIMIT_NOFILE", "hard": nofile.Max, "soft": nofile.Max}}
	cfg["root"] = map[string]any{"path": r.rootfs, "readonly": true}
	cfg["hostname"] = name
	mounts := cfg["mounts"].([]any)
	mounts = append(mounts, map[string]any{"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": []string{"nosuid", "nodev", "mode=1777"}})
	for _, m := range s.binds {
		opts := []string{"rbind", "nosuid", "nodev"}
		if m.ro {
			opts = append(opts, "ro")
		}
		mounts = append(mounts, map[string]any{"destination": m.dst, "type": "bind", "source": m.src, "options": opts})
	}
	cfg["mounts"] = mounts
	linux := cfg["linux"].(map[string]any)
	var nss []any
	for _, ns := range linux["namespaces"].([]any) {
		if ns.(map[string]any)["type"] != "network" { // the host's network
			nss = append(nss, ns)
		}
	}
	linux["namespaces"] = nss
	if fi, err := os.Stat("/dev/kvm"); s.kvm && err == nil && fi.Mode()&os.ModeCharDevice != 0 {
		st := fi.Sys().(*syscall.Stat_t)
		major, minor := int64(st.Rdev>>8&0xfff), int64(st.Rdev&0xff|st.Rdev>>12&0xfff00)
		linux["devices"] = []any{map[string]any{"path": "/dev/kvm", "type": "c", "major": major, "minor": minor, "fileMode": 0o666, "uid": 0, "gid": 0}}
		res := linux["resources"].(map[string]any)
		res["devices"] = append(res["devices"].([]any), map[string]any{"allow": true, "type": "c", "major": major, "minor": minor, "access": "rwm"})
	}
	if b, err = json.MarshalIndent(cfg, "", "  "); err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(bundle, "config.json"), string(b))

	id := fmt.Sprintf("qk-e2e-%s-%d", name, os.Getpid())
	logPath := filepath.Join(filepath.Dir(r.rootfs), name+".log")
	logf, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("runc", "--root", r.root, "run", "--bundle", bundle, id)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatalf("runc run %s: %v", name, err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); logf.Close(); close(done) }()
	t.Cleanup(func() {
		_ = exec.Command("runc", "--root", r.root, "kill", id, "TERM").Run()
		select {
		case <-done:
		case <-time.After(15 * time.Second):
			_ = exec.Command("runc", "--root", r.root, "kill", id, "KILL").Run()
			<-done
		}
		_ = exec.Command("runc", "--root", r.root, "delete", "--force", id).Run()
		if t.Failed() {
			b, _ := os.ReadFile(logPath)
			t.Logf("%s container log (tail):\n%s", name, tail(string(b), 60))
		}
	})
	if !waitFor(30*time.Second, 200*time.Millisecond, func() bool { return r.pid(id) > 0 }) {
		b, _ := os.ReadFile(logPath)
		t.Fatalf("container %s never ran:\n%s", name, tail(string(b), 30))
	}
	return id
}

// pid is the container's init process as runc sees it (0 if not running).
func (r *runcEnv) pid(id string) int {
	out, err := exec.Command("runc", "--root", r.root, "state", id).Output()
	if err != nil {
		return 0
	}
	var st struct {
		Pid    int    `json:"pid"`
		Status string `json:"status"`
	}
	if json.Unmarshal(out, &st) != nil || st.Status != "running" {
		return 0
	}
	return st.Pid
}
