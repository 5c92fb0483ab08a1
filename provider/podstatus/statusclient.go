package podstatus

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
)

// StatusWriter wraps the pod client the virtual-kubelet library writes pod
// statuses with, so that a status write is what the kubelet's status
// manager sends: a patch of pods/status holding the status alone and the
// pod's UID as a precondition, not the library's PUT of its whole copy of
// the pod.
//
// The PUT carried the resource version of the library's informer copy and
// the provider's labels. In a burst the informer lags a starved API server,
// so writes of the same pod conflicted ("the object has been modified") and
// were retried with the queue's back-off (62 conflicts for 60 pods in
// BenchmarkBurst): more requests through the node's client budget and Ready
// seen later. And the API server's NodeRestriction refuses a node's status
// update whose labels differ from the stored pod's ("node cannot update
// labels through pod status"), so a label set after the provider's copy was
// taken (an ExporterSet lease landing between a status push and its write)
// lost that write. A status patch has neither problem: the status is the
// node's to write, the metadata is not.
//
// The patch is a JSON merge patch (RFC 7386): lists (conditions, container
// statuses) are replaced whole, as the PUT replaced them; a field the status
// no longer has is sent as null so it is cleared (statusPatch). A pod
// deleted and created again under the same name has a new UID: the patch's
// UID does not match it and the API server refuses the write (the UID is
// immutable), so an old incarnation's status never lands on the new pod;
// the writer returns that refusal as NotFound (the pod of that UID is gone).
func StatusWriter(pods corev1client.PodsGetter) corev1client.PodsGetter {
	return statusWriter{pods}
}

type statusWriter struct{ corev1client.PodsGetter }

func (w statusWriter) Pods(namespace string) corev1client.PodInterface {
	return statusPods{w.PodsGetter.Pods(namespace)}
}

type statusPods struct{ corev1client.PodInterface }

// UpdateStatus patches pod's status (statusPatch); pod's resource version,
// labels and annotations are not sent.
func (p statusPods) UpdateStatus(ctx context.Context, pod *corev1.Pod, opts metav1.UpdateOptions) (*corev1.Pod, error) {
	patch, err := statusPatch(pod)
	if err != nil {
		return nil, fmt.Errorf("status of pod %s/%s: %w", pod.Namespace, pod.Name, err)
	}
	out, err := p.Patch(ctx, pod.Name, types.MergePatchType, patch,
		metav1.PatchOptions{DryRun: opts.DryRun, FieldManager: opts.FieldManager}, "status")
	if uidMismatch(err) {
		// The pod this status is of is gone; the name is a newer pod's.
		// Said as NotFound, which is what it is to the caller (the library
		// drops a status whose pod was not found).
		return nil, &apierrors.StatusError{ErrStatus: metav1.Status{
			Status: metav1.StatusFailure, Code: http.StatusNotFound, Reason: metav1.StatusReasonNotFound,
			Details: &metav1.StatusDetails{Kind: "pods", Name: pod.Name, UID: pod.UID},
			Message: fmt.Sprintf("pod %s/%s with UID %s not found: the name is another pod's now (%v)", pod.Namespace, pod.Name, pod.UID, err),
		}}
	}
	return out, err
}

// clearableStatusFields are the status fields the node writes that a newer
// status may no longer have: absent from the newer status, they are sent as
// null (a merge patch keeps what it does not name). Fields others write
// (qosClass, nominatedNodeName, resize, resourceClaimStatuses,
// observedGeneration) are left alone.
var clearableStatusFields = []string{
	"message", "reason", "hostIP", "hostIPs", "podIP", "podIPs", "startTime",
	"conditions", "containerStatuses", "initContainerStatuses", "ephemeralContainerStatuses",
}

// statusPatch is the merge patch that writes pod's status:
// {"metadata":{"uid":...},"status":{...}} with clearableStatusFields the
// status lacks set to null. Pure.
func statusPatch(pod *corev1.Pod) ([]byte, error) {
	if pod.UID == "" {
		return nil, fmt.Errorf("no UID to write the status under")
	}
	b, err := json.Marshal(pod.Status)
	if err != nil {
		return nil, fmt.Errorf("encode status: %w", err)
	}
	status := map[string]any{}
	if err := json.Unmarshal(b, &status); err != nil {
		return nil, fmt.Errorf("encode status: %w", err)
	}
	for _, f := range clearableStatusFields {
		if _, ok := status[f]; !ok {
			status[f] = nil
		}
	}
	return json.Marshal(map[string]any{
		"metadata": map[string]any{"uid": pod.UID},
		"status":   status,
	})
}

// FinalDelete is what a kubelet does once a deleted pod's VM is gone: write
// the terminal status, then delete the pod object with grace 0. Both carry
// the pod's UID as a precondition (the status patch, the delete's
// Preconditions): a newer pod of the same name is never written or
// deleted. Two requests per pod, none retried (it read, wrote and re-read
// each pod before: up to 5 requests per pod of a delete burst through the
// node's client budget).
func FinalDelete(ctx context.Context, pods corev1client.PodsGetter, pod *corev1.Pod) error {
	_, err := StatusWriter(pods).Pods(pod.Namespace).UpdateStatus(ctx, pod, metav1.UpdateOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return nil // gone, or the name is a newer pod's (UpdateStatus)
	}
	// Any other failure of the status write (a status the API server
	// refuses, a timeout) does not keep the pod object: the delete is what
	// the user waits for.
	zero := int64(0)
	err = pods.Pods(pod.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{GracePeriodSeconds: &zero, Preconditions: metav1.NewUIDPreconditions(string(pod.UID))})
	if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
		return fmt.Errorf("delete pod %s/%s: %w", pod.Namespace, pod.Name, err)
	}
	return nil
}

// uidMismatch reports whether err is the API server's refusal of a status
// patch whose UID is not the stored pod's (422, metadata.uid immutable).
func uidMismatch(err error) bool {
	if !apierrors.IsInvalid(err) {
		return false
	}
	var status apierrors.APIStatus
	if !errors.As(err, &status) || status.Status().Details == nil {
		return false
	}
	for _, c := range status.Status().Details.Causes {
		if c.Field == "metadata.uid" {
			return true
		}
	}
	return false
}
