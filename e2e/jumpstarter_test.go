package e2e

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/jstest"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/pb"
	"github.com/qemu-kubelet/qemu-kubelet/provider/exporter"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/qemu-kubelet/qemu-kubelet/provider/vmtest"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/crypto/ssh"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func jsCondition(p *corev1.Pod) *corev1.PodCondition {
	for i := range p.Status.Conditions {
		if p.Status.Conditions[i].Type == exporter.Condition {
			return &p.Status.Conditions[i]
		}
	}
	return nil
}

func jsOnline(p *corev1.Pod) bool {
	c := jsCondition(p)
	return c != nil && c.Status == corev1.ConditionTrue
}

// testJumpstarter: a VM pod made a Jumpstarter exporter by a Secret created
// with kubectl, served by the node agent process to jstest's controller and
// router (TLS, in the test process), driven through the router as jmp
// does; the controller restarts mid-session and the agent is killed -9:
// the exporter comes back Online each time; delete unregisters it.
func (e *podEnv) testJumpstarter(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	ctrl, err := jstest.Start(jstest.Options{DialWait: 30 * time.Second})
	require.NoError(t, err)
	t.Cleanup(ctrl.Close)
	const ns, exporter = "lab", "e2e-board"
	token := ctrl.AddExporter(ns, exporter, "")
	caFile := filepath.Join(t.TempDir(), "ca.crt")
	require.NoError(t, os.WriteFile(caFile, ctrl.CABundle(), 0o600))

	// The pod references the Secret from a volume: the Node authorizer then
	// lets this node read it (an annotation alone is no reference); the
	// node keeps that volume on the host.
	// The guest login, as the ExporterSet controller generates one: the
	// node seeds it into the guest (NoCloud vendor-data), the exporter
	// answers it to get_username and get_password.
	pw := make([]byte, 24)
	_, err = rand.Read(pw)
	require.NoError(t, err)
	_, err = e.c.Kubectl(ctx, "create", "secret", "generic", "js-e2e", "-n", "default", "--from-literal=endpoint="+ctrl.Endpoint(),
		"--from-literal=token="+token, "--from-literal=namespace="+ns, "--from-literal=name="+exporter, "--from-file=ca.crt="+caFile,
		"--from-literal="+v1alpha1.JumpstarterSecretUsername+"="+v1alpha1.GeneratedGuestLoginUser,
		"--from-literal="+v1alpha1.JumpstarterSecretPassword+"="+base64.RawURLEncoding.EncodeToString(pw))
	require.NoError(t, err)
	t.Cleanup(func() {
		_, _ = e.c.Kubectl(context.Background(), "delete", "-n", "default", "secret/js-e2e", "--ignore-not-found")
	})

	pod := vmPodSpec("js-board", e.a.name, e.refs[vmtest.VariantACPI], corev1.RestartPolicyAlways,
		map[string]string{v1alpha1.JumpstarterSecretAnnotation: "js-e2e"})
	grace := int64(6)
	pod.Spec.TerminationGracePeriodSeconds = &grace
	pod.Labels = map[string]string{"jumpstarter.dev/board": "qemu-e2e"}
	pod.Spec.Containers[0].Ports = []corev1.ContainerPort{{Name: "http", ContainerPort: 8080}}
	pod.Spec.Volumes = append(pod.Spec.Volumes, corev1.Volume{Name: "jumpstarter-credentials",
		VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{SecretName: "js-e2e"}}})
	p := e.create(t, pod)
	p = waitPod(t, e.c, "default", p.Name, 180*time.Second, "Running with the exporter Online", func(p *corev1.Pod) bool {
		return podRunning(p) && jsOnline(p)
	})
	dir := e.a.vmDir(string(p.UID))
	waitFileContains(t, filepath.Join(dir, qemu.ConsoleLogName), vmtest.BootMarker, 120*time.Second)
	// The Secret's volume stays on the host: no file of the VM (guest
	// disks, overlay, records) holds the token.
	require.NoError(t, filepath.WalkDir(dir, func(path string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() || d.Type()&os.ModeType != 0 {
			return nil // sockets, vanished files
		}
		b, rerr := os.ReadFile(path)
		if rerr == nil && strings.Contains(string(b), token) {
			t.Errorf("%s holds the exporter token", path)
		}
		return nil
	}))
	st, err := ctrl.WaitExporter(ctx, ns, exporter, func(s jstest.ExporterState) bool { return s.Online })
	require.NoError(t, err)
	assert.Equal(t, map[string]string{"jumpstarter.dev/board": "qemu-e2e", "jumpstarter.dev/name": exporter}, st.Labels, "the pod's jumpstarter.dev/ labels and the exporter's name, as upstream's exporter registers")
	out, err := e.c.Kubectl(ctx, "get", "pod", p.Name, "-o", `jsonpath={.status.conditions[?(@.type=="qemu-kubelet.io/JumpstarterExporter")].reason}`)
	require.NoError(t, err)
	assert.Equal(t, "Online", out)

	require.NoError(t, ctrl.AssignLease(ns, "lease-e2e", exporter, "ci"))
	cl := ctrl.NewClient(ns, "ci")
	session := func() (*jstest.Session, func(string) string) {
		s, err := cl.Dial(ctx, "lease-e2e")
		require.NoError(t, err)
		rep, err := s.GetReport(ctx)
		require.NoError(t, err)
		return s, func(n string) string {
			d, ok := jstest.FindDriver(rep, n)
			require.True(t, ok, "driver %q", n)
			return d.GetUuid()
		}
	}
	s, uuidOf := session()
	con, err := s.Stream(ctx, uuidOf("console"), "connect")
	require.NoError(t, err)
	_, err = con.Write([]byte("hello-e2e\n"))
	require.NoError(t, err)
	testutil.ReadUntil(t, con, "QK-ECHO: hello-e2e", 30*time.Second)
	con.Close()
	e.checkSSHChild(ctx, t, s, dir)

	_, err = s.Call(ctx, uuidOf("power"), "off")
	require.NoError(t, err)
	p = waitPod(t, e.c, "default", p.Name, 30*time.Second, "PoweredOff", func(p *corev1.Pod) bool {
		w := p.Status.ContainerStatuses[0].State.Waiting
		return w != nil && w.Reason == podstatus.ReasonPoweredOff
	})
	assert.Equal(t, corev1.PodRunning, p.Status.Phase)
	assert.Equal(t, int32(0), p.Status.ContainerStatuses[0].RestartCount)
	out, err = e.c.Kubectl(ctx, "get", "pod", p.Name)
	require.NoError(t, err)
	assert.Contains(t, out, "PoweredOff")
	assert.Empty(t, vmtest.QEMUPids(dir))
	_, err = s.Call(ctx, uuidOf("power"), "on")
	require.NoError(t, err)
	waitPod(t, e.c, "default", p.Name, 30*time.Second, "Running again", podRunning)
	waitFileContains(t, filepath.Join(dir, qemu.ConsoleLogName), vmtest.BootMarker, 120*time.Second)
	s.Close()

	// The controller restarts mid-session: the exporter registers again.
	before, _ := ctrl.ExporterState(ns, exporter)
	ctrl.Stop()
	waitPod(t, e.c, "default", p.Name, 60*time.Second, "exporter not Online", func(p *corev1.Pod) bool { return !jsOnline(p) })
	require.NoError(t, ctrl.Start())
	_, err = ctrl.WaitExporter(ctx, ns, exporter, func(s jstest.ExporterState) bool {
		return s.Online && s.Registrations > before.Registrations
	})
	require.NoError(t, err, "re-registered after the controller restart")
	waitPod(t, e.c, "default", p.Name, 60*time.Second, "exporter Online again", jsOnline)
	s, uuidOf = session()
	v, err := s.Call(ctx, uuidOf(""), "get_hostname")
	require.NoError(t, err)
	assert.Equal(t, p.Name, v)
	s.Close()

	// The agent is killed -9 and started again: the re-adopted VM's
	// exporter is Online again; the VM never stopped.
	pids := vmtest.QEMUPids(dir)
	require.Len(t, pids, 1)
	before, _ = ctrl.ExporterState(ns, exporter)
	_ = e.a.kill(syscall.SIGKILL)
	e.a.start()
	_, err = ctrl.WaitExporter(ctx, ns, exporter, func(s jstest.ExporterState) bool {
		return s.Online && s.Registrations > before.Registrations
	})
	require.NoError(t, err, "the re-adopted VM's exporter registers again")
	waitPod(t, e.c, "default", p.Name, 90*time.Second, "exporter Online after the agent restart", func(p *corev1.Pod) bool {
		return podRunning(p) && jsOnline(p)
	})
	assert.Equal(t, pids, vmtest.QEMUPids(dir), "the VM kept running")
	s, uuidOf = session()
	_, err = s.Call(ctx, uuidOf("power"), "on")
	require.NoError(t, err, "served by the restarted agent")
	s.Close()
	st, _ = ctrl.ExporterState(ns, exporter)
	assert.Equal(t, pb.ExporterStatus_EXPORTER_STATUS_LEASE_READY, st.Status)

	require.NoError(t, e.c.Client().CoreV1().Pods("default").Delete(ctx, p.Name, metav1.DeleteOptions{}))
	waitPodGone(t, e.c, "default", p.Name, 60*time.Second)
	waitNoDir(t, dir, 30*time.Second)
	st, _ = ctrl.ExporterState(ns, exporter)
	assert.True(t, st.Unregistered, "a deleted pod's exporter unregisters")
}

// checkSSHChild: the exporter reports the default ssh child (the pod names
// no port ssh), a NetworkClient as upstream's QEMU driver reports it, and
// its connect reaches the guest's TCP port 22, where the test image runs
// sshd (dropbear) with the login the node seeded from the pod's exporter
// Secret: an ssh client through the router logs in with get_username and
// get_password, as shell() does, and runs id -un; a wrong password is
// refused. The child adds no QEMU process.
func (e *podEnv) checkSSHChild(ctx context.Context, t *testing.T, s *jstest.Session, dir string) {
	t.Helper()
	rep, err := s.GetReport(ctx)
	require.NoError(t, err)
	d, ok := jstest.FindDriver(rep, "ssh")
	require.True(t, ok, "the default ssh child is reported")
	assert.Equal(t, "jumpstarter_driver_network.client.NetworkClient", d.Labels["jumpstarter.dev/client"])
	root, ok := jstest.FindDriver(rep, "")
	require.True(t, ok, "the root driver")
	call := func(m string) string {
		v, err := s.Call(ctx, root.GetUuid(), m)
		require.NoError(t, err, m)
		str, _ := v.(string)
		return str
	}
	user, pass := call("get_username"), call("get_password")
	require.Equal(t, v1alpha1.GeneratedGuestLoginUser, user, "get_username is the Secret's")
	require.NotEmpty(t, pass, "get_password is the Secret's")
	waitFileContains(t, filepath.Join(dir, qemu.ConsoleLogName), "QK-LOGIN-USER "+user+" ", 30*time.Second)

	_, err = sshThrough(ctx, t, s, d.GetUuid(), user, pass+"-wrong")
	require.Error(t, err, "a wrong password is refused")
	assert.Contains(t, err.Error(), "unable to authenticate", "refused at authentication, not before")

	c, err := sshThrough(ctx, t, s, d.GetUuid(), user, pass)
	require.NoError(t, err, "ssh login as %s with get_password's password through the ssh child", user)
	defer c.Close()
	sess, err := c.NewSession()
	require.NoError(t, err)
	defer sess.Close()
	out, err := sess.CombinedOutput("id -un")
	require.NoError(t, err, "id -un over ssh: %s", out)
	assert.Equal(t, user, strings.TrimSpace(string(out)), "the guest runs the command as the seeded user")
	assert.Len(t, vmtest.QEMUPids(dir), 1, "one QEMU, as before")
}

// sshThrough opens the ssh child's connect stream through the router and
// logs in over it with user and password (never logged); the handshake
// (the guest's sshd makes its host key then) has 2 minutes.
func sshThrough(ctx context.Context, t *testing.T, s *jstest.Session, uuid, user, password string) (*ssh.Client, error) {
	t.Helper()
	st, err := s.Stream(ctx, uuid, "connect")
	require.NoError(t, err, "the ssh child's connect stream")
	conn, far := net.Pipe()
	go func() { _, _ = io.Copy(far, st); far.Close() }()
	go func() { _, _ = io.Copy(st, far); st.Close() }()
	cfg := &ssh.ClientConfig{User: user, Auth: []ssh.AuthMethod{ssh.Password(password)},
		HostKeyCallback: ssh.InsecureIgnoreHostKey()} // a fresh guest's key: nothing to pin
	require.NoError(t, conn.SetDeadline(time.Now().Add(2*time.Minute)))
	cc, chans, reqs, err := ssh.NewClientConn(conn, "guest:22", cfg)
	if err != nil {
		conn.Close()
		return nil, err
	}
	require.NoError(t, conn.SetDeadline(time.Time{}))
	return ssh.NewClient(cc, chans, reqs), nil
}
