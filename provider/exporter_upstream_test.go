package provider

import (
	"context"
	"encoding/base64"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/record"

	jsv1 "github.com/qemu-kubelet/qemu-kubelet/api/jumpstarter/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/jstest"
	"github.com/qemu-kubelet/qemu-kubelet/oci"
)

// endingRunner is an exporter.Runner whose runs the test ends with an
// error of its choice (or that end with their context).
type endingRunner struct {
	ch chan endingRun
}

type endingRun struct {
	cfg jumpstarter.Config
	end chan error
}

func (f *endingRunner) RunExporter(ctx context.Context, cfg jumpstarter.Config) error {
	r := endingRun{cfg: cfg, end: make(chan error, 1)}
	f.ch <- r
	select {
	case err := <-r.end:
		return err
	case <-ctx.Done():
		return nil
	}
}

// TestExporterUpstreamLayoutFake: a pod in upstream Jumpstarter's layout
// (its exporter Secret mounted at /etc/jumpstarter/exporters, no
// annotation) is served from the Secret's config.yaml, with a fake runner
// and no QEMU (the image cannot be pulled; the test starts the supervisor
// as the worker would): a malformed config.yaml shows in the exporter
// condition naming the field, never the token, and starts nothing; a fixed
// one starts the exporter with its settings (the CA base64 decoded,
// exitOnLeaseEnd); the exporter's exit at lease end leaves it Stopped for
// good, never restarted.
func TestExporterUpstreamLayoutFake(t *testing.T) {
	root := t.TempDir()
	store, err := oci.Open(filepath.Join(root, "images"), oci.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { store.Close() })
	secrets := &secretStore{m: map[string]*corev1.Secret{}}
	runner := &endingRunner{ch: make(chan endingRun, 16)}
	h := newHarnessWith(t, filepath.Join(root, "state"), store, filepath.Join(root, "images"), func(c *VMsConfig) {
		c.Secrets = secrets.get
		c.Exporters = runner
		c.Recorder = record.NewFakeRecorder(100)
	})
	ctx := context.Background()
	pod := podFor("u-up", "127.0.0.1:1/qemu-kubelet/none:1", corev1.RestartPolicyAlways, nil)
	pod.Namespace = "lab"
	pod.Spec.Volumes = append(pod.Spec.Volumes, corev1.Volume{Name: "exporter-config",
		VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{SecretName: "exporter-config-pool-1"}}})
	pod.Spec.Containers[0].VolumeMounts = append(pod.Spec.Containers[0].VolumeMounts,
		corev1.VolumeMount{Name: "exporter-config", MountPath: jsv1.ExporterConfigMountPath, ReadOnly: true})
	// A real CA bundle (jstest's), as the operator's ConfigMap holds one.
	ctrl, err := jstest.Start(jstest.Options{})
	require.NoError(t, err)
	t.Cleanup(ctrl.Close)
	const token = "up-s3cr3t-token-1"
	doc := func(insecure bool) string {
		return fmt.Sprintf("apiVersion: jumpstarter.dev/v1alpha1\nkind: ExporterConfig\nmetadata: {name: pool-1, namespace: lab}\nendpoint: grpc.example:443\ntls: {ca: %s, insecure: %t}\ntoken: %s\nexitOnLeaseEnd: true\n",
			base64.StdEncoding.EncodeToString(ctrl.CABundle()), insecure, token)
	}
	put := func(d string) {
		secrets.put(&corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: "lab", Name: "exporter-config-pool-1"},
			Data: map[string][]byte{jsv1.ExporterConfigSecretKey: []byte(d)}})
	}

	put(doc(true))
	require.NoError(t, h.vms.CreatePod(ctx, pod))
	run := h.vms.runOf(pod.UID)
	require.NotNil(t, run)
	run.startExporter(h.vms.base)

	p := h.wait(pod.UID, 10*time.Second, "exporter Failed (tls.insecure)", func(p *corev1.Pod) bool {
		c := exporterCond(p)
		return c != nil && c.Reason == "Failed" && strings.Contains(c.Message, "tls.insecure")
	})
	assert.Contains(t, exporterCond(p).Message, `"exporter-config-pool-1" (volume "exporter-config" mounted at /etc/jumpstarter/exporters`)
	assert.Contains(t, exporterCond(p).Message, "tls.insecure: true is refused")
	assert.NotContains(t, exporterCond(p).Message, token)
	select {
	case r := <-runner.ch:
		t.Fatalf("an exporter started from a refused config: %s", r.cfg.Name)
	default:
	}

	put(doc(false))
	var r endingRun
	select {
	case r = <-runner.ch:
	case <-time.After(30 * time.Second):
		t.Fatal("no exporter run within 30 s of the fixed config.yaml (retried with back-off)")
	}
	assert.Equal(t, "grpc.example:443", r.cfg.Endpoint)
	assert.Equal(t, "lab", r.cfg.Namespace)
	assert.Equal(t, "pool-1", r.cfg.Name)
	assert.Equal(t, token, r.cfg.Token)
	assert.Equal(t, ctrl.CABundle(), r.cfg.CABundle)
	assert.True(t, r.cfg.ExitOnLeaseEnd)

	r.cfg.OnState(jumpstarter.StateLeased, nil)
	h.wait(pod.UID, 5*time.Second, "Leased", condReason("Leased"))
	r.end <- fmt.Errorf("lease lease-1: %w", jumpstarter.ErrExitOnLeaseEnd)
	p = h.wait(pod.UID, 5*time.Second, "exporter Stopped after the lease", condReason("Stopped"))
	assert.Contains(t, exporterCond(p).Message, "exitOnLeaseEnd")
	assert.Equal(t, corev1.ConditionFalse, exporterCond(p).Status)
	select {
	case r := <-runner.ch:
		t.Fatalf("the exporter was started again after it exited at lease end: %s", r.cfg.Name)
	case <-time.After(2 * time.Second): // longer than the first back-off of a restart
	}
}
