package provider

import (
	"context"
	"fmt"
	"maps"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
)

// StatusWriter wraps the pod client the virtual-kubelet library writes pod
// statuses with. The library sends the provider's whole copy of the pod to
// pods/status, labels included, with the resource version of its informer
// copy. The API server's NodeRestriction refuses a node's status update
// whose labels differ from the stored pod's ("node cannot update labels
// through pod status"), so a label set on the pod after the provider's copy
// was taken (an ExporterSet lease landing between a status push and its
// write) loses that write. The kubelet does not meet this: it patches the
// status alone.
//
// On a Forbidden answer, the writer reads the pod, and if it is the same
// pod (UID) with other labels or annotations, retries once with the
// stored metadata and resource version: the status is the node's to write,
// the metadata is not. Any other error is returned as it came. Found by the
// chaos soak (three refusals in 30 minutes with the provider's own metadata
// refresh in place).
func StatusWriter(pods corev1client.PodsGetter) corev1client.PodsGetter {
	return statusWriter{pods}
}

type statusWriter struct{ corev1client.PodsGetter }

func (w statusWriter) Pods(namespace string) corev1client.PodInterface {
	return statusPods{w.PodsGetter.Pods(namespace)}
}

type statusPods struct{ corev1client.PodInterface }

func (p statusPods) UpdateStatus(ctx context.Context, pod *corev1.Pod, opts metav1.UpdateOptions) (*corev1.Pod, error) {
	out, err := p.PodInterface.UpdateStatus(ctx, pod, opts)
	if err == nil || !apierrors.IsForbidden(err) {
		return out, err
	}
	cur, gerr := p.Get(ctx, pod.Name, metav1.GetOptions{})
	if gerr != nil || cur.UID != pod.UID ||
		(maps.Equal(cur.Labels, pod.Labels) && maps.Equal(cur.Annotations, pod.Annotations)) {
		// Not a metadata mismatch this writer can repair.
		return out, err
	}
	retry := pod.DeepCopy()
	retry.Labels = maps.Clone(cur.Labels)
	retry.Annotations = maps.Clone(cur.Annotations)
	retry.ResourceVersion = cur.ResourceVersion
	out, rerr := p.PodInterface.UpdateStatus(ctx, retry, opts)
	if rerr != nil {
		return out, fmt.Errorf("update status of pod %s/%s with its stored labels after %v: %w", pod.Namespace, pod.Name, err, rerr)
	}
	return out, nil
}
