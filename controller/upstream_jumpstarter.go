package controller

import (
	"context"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"strconv"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/rand"
	"sigs.k8s.io/controller-runtime/pkg/client"
	logf "sigs.k8s.io/controller-runtime/pkg/log"

	jsv1 "github.com/qemu-kubelet/qemu-kubelet/api/jumpstarter/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	vtv1 "github.com/qemu-kubelet/qemu-kubelet/api/virtualtarget/v1alpha1"
)

// An upstream set's instances in Jumpstarter: each pod gets an Exporter
// (the pod's name, enabled, owned by the pod) and, once Jumpstarter issued
// its credential, the exporter Secret the node's exporter reads; the pod
// waits at the scheduling gate until then. The steps are those of our own
// API's Jumpstarter mode (jsTarget, jsClient), under upstream's names.

// Upstream's names for what a set makes.
const (
	// UpstreamExporterSetLabel names the set on its pods, Exporters and
	// exporter Secrets (upstream's exporter-set-controller's label).
	UpstreamExporterSetLabel = "exporterset.jumpstarter.dev/name"
	// upstreamCAConfigMap and upstreamCAKey hold the CA bundle of
	// Jumpstarter's controller and router certificates in the set's
	// namespace (written by Jumpstarter's operator).
	upstreamCAConfigMap = "jumpstarter-service-ca-cert"
	upstreamCAKey       = "ca.crt"
)

// upstreamSecretName is the name of the exporter Secret of the exporter
// (and pod) named exporter: upstream's exporter-config-<exporter>.
func upstreamSecretName(exporter string) string { return jsv1.ExporterConfigSecretName(exporter) }

// upstreamTarget is an upstream set as the Jumpstarter steps see it: the
// template's labels are the Exporters' (Leases select on them), the
// endpoint is each Exporter's status.endpoint, ca the CA bundle; the
// exporter Secrets hold upstream's config.yaml too.
func upstreamTarget(set *vtv1.ExporterSet, reuse bool, ca string) jsTarget {
	return jsTarget{
		Obj:        set,
		Owner:      *metav1.NewControllerRef(set, vtv1.GroupVersion.WithKind("ExporterSet")),
		Spec:       &v1alpha1.JumpstarterSpec{ExporterLabels: set.Spec.Template.Metadata.Labels, CABundle: ca},
		Reuse:      reuse,
		SetLabel:   UpstreamExporterSetLabel,
		SecretName: upstreamSecretName,
		ExporterConfig: func(namespace, name, endpoint string, token []byte) ([]byte, error) {
			return upstreamExporterConfig(set, reuse, ca, namespace, name, endpoint, token)
		},
	}
}

// upstreamHash is the hash an upstream set's pods carry: the pod
// template's and the Exporters' labels (new labels roll the pods, whose
// Exporters carry the old ones).
func upstreamHash(t *corev1.PodTemplateSpec, exporterLabels map[string]string) string {
	h := fnv.New32a()
	b, _ := json.Marshal(struct {
		T *corev1.PodTemplateSpec
		L map[string]string
	}{t, exporterLabels})
	h.Write(b)
	return rand.SafeEncodeString(strconv.FormatUint(uint64(h.Sum32()), 10))
}

func (r *UpstreamReconciler) js() jsClient {
	rd := r.APIReader
	if rd == nil {
		rd = r.Client
	}
	return jsClient{Client: r.Client, Reader: rd, Recorder: r.Recorder}
}

// caBundle reads the CA bundle Jumpstarter's operator keeps in the
// namespace ("" when there is none: the exporter then trusts the system's
// roots).
func (r *UpstreamReconciler) caBundle(ctx context.Context, ns string) (string, error) {
	var cm corev1.ConfigMap
	if err := r.js().Reader.Get(ctx, types.NamespacedName{Namespace: ns, Name: upstreamCAConfigMap}, &cm); err != nil {
		if apierrors.IsNotFound(err) {
			return "", nil
		}
		return "", fmt.Errorf("read CA bundle ConfigMap %s/%s: %w", ns, upstreamCAConfigMap, err)
	}
	return cm.Data[upstreamCAKey], nil
}

// executeJumpstarter carries out the plan's Exporter actions and pod
// marks; it returns the deletions that may go now (see
// jsClient.executeJumpstarter).
func (r *UpstreamReconciler) executeJumpstarter(ctx context.Context, target jsTarget, js *jsState, acts Actions, now time.Time) []Deletion {
	log := logf.FromContext(ctx)
	ns := target.Obj.GetNamespace()
	del := r.js().executeJumpstarter(ctx, target, js, acts, now)
	for _, p := range acts.MarkUsed {
		patch := fmt.Appendf(nil, `{"metadata":{"resourceVersion":%q,"labels":{%q:"true"}}}`, p.ResourceVersion, v1alpha1.UsedLabel)
		if err := r.Client.Patch(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: p.Name, Namespace: ns}}, client.RawPatch(types.MergePatchType, patch)); err != nil && !apierrors.IsNotFound(err) {
			log.Info("add used mark", "pod", p.Name, "err", err.Error())
		}
	}
	for _, p := range acts.ClearUsed {
		patch := fmt.Appendf(nil, `{"metadata":{"resourceVersion":%q,"labels":{%q:null}}}`, p.ResourceVersion, v1alpha1.UsedLabel)
		if err := r.Client.Patch(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: p.Name, Namespace: ns}}, client.RawPatch(types.MergePatchType, patch)); err != nil && !apierrors.IsNotFound(err) {
			log.Info("clear used mark", "pod", p.Name, "err", err.Error())
		}
	}
	return del
}

// createPod creates one gated pod of an upstream set and its Exporter. A
// failed Exporter create is retried by the next pass (setupPods).
func (r *UpstreamReconciler) createPod(ctx context.Context, set *vtv1.ExporterSet, target jsTarget, t *corev1.PodTemplateSpec, hash string) (*corev1.Pod, error) {
	var pod *corev1.Pod
	var err error
	for range 3 { // a name taken by chance: draw another
		pod = newUpstreamPod(set, t, hash)
		gateForExporter(pod, set.Name, upstreamSecretName)
		if err = r.Client.Create(ctx, pod); !apierrors.IsAlreadyExists(err) {
			break
		}
	}
	if err != nil {
		return nil, err
	}
	if err := r.Client.Create(ctx, newExporter(target, pod)); err != nil && !apierrors.IsAlreadyExists(err) {
		logf.FromContext(ctx).Info("create exporter; retried on the next pass", "exporter", pod.Name, "err", err.Error())
	}
	return pod, nil
}

// exporterCounts are upstream's exporter counts of a set's pods'
// Exporters: active (leased), idle (online, enabled, not leased),
// disabled, offline (enabled, not leased, not online; a pod without an
// Exporter yet counts here).
func exporterCounts(pods []corev1.Pod, exporters map[string]*jsv1.Exporter) (active, idle, disabled, offline int32) {
	for i := range pods {
		e := exporters[pods[i].Name]
		switch {
		case e == nil:
			offline++
		case e.Status.LeaseRef != nil:
			active++
		case !e.IsEnabled():
			disabled++
		case meta.IsStatusConditionTrue(e.Status.Conditions, jsv1.ExporterConditionOnline):
			idle++
		default:
			offline++
		}
	}
	return active, idle, disabled, offline
}
