// Package exs is the logic of the kubectl plugin kubectl-exs: leasing,
// releasing and listing the pods of ExporterSets by the label protocol of
// docs/exporterset.md (v1alpha1.LeaseLabel, v1alpha1.UsedLabel and the
// lease annotations). The decisions (which pod is free, the patches, the
// table) are pure functions over plain objects; Client applies them
// through the Kubernetes API.
package exs

import (
	"fmt"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
)

// State is what a pod of a set is to a client.
type State string

// Pod states, as `kubectl exs list` shows them.
const (
	// Free: Ready, neither leased nor used, not being deleted: claimable.
	Free State = "free"
	// Leased: carries the lease label and its expiry, if any, is ahead.
	Leased State = "leased"
	// Expired: carries the lease label but its expiry passed; the
	// controller is about to recycle it.
	Expired State = "expired"
	// Booting: not Ready yet (pending, pulling, booting, failing probes).
	Booting State = "booting"
	// Recycling: released (used mark without lease) or being deleted.
	Recycling State = "recycling"
	// Failed: the pod ended (phase Failed or Succeeded).
	Failed State = "failed"
)

// Classify says what pod is at now, by the label protocol.
func Classify(p *corev1.Pod, now time.Time) State {
	_, leased := p.Labels[v1alpha1.LeaseLabel]
	_, used := p.Labels[v1alpha1.UsedLabel]
	switch {
	case leased:
		if t, ok := Expiry(p); ok && !now.Before(t) {
			return Expired
		}
		return Leased
	case p.DeletionTimestamp != nil || used:
		return Recycling
	case p.Status.Phase == corev1.PodFailed || p.Status.Phase == corev1.PodSucceeded:
		return Failed
	case !podReady(p):
		return Booting
	}
	return Free
}

// Expiry is the pod's lease expiry (v1alpha1.LeaseExpiresAnnotation), if
// it has a valid one.
func Expiry(p *corev1.Pod) (time.Time, bool) {
	v, ok := p.Annotations[v1alpha1.LeaseExpiresAnnotation]
	if !ok {
		return time.Time{}, false
	}
	t, err := time.Parse(time.RFC3339, v)
	return t, err == nil
}

// LeasedAt is when the pod's lease began (v1alpha1.LeasedAtAnnotation), if
// the claim recorded it.
func LeasedAt(p *corev1.Pod) (time.Time, bool) {
	t, err := time.Parse(time.RFC3339, p.Annotations[v1alpha1.LeasedAtAnnotation])
	return t, err == nil
}

func podReady(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// SetPods returns the pods of pods that set controls (owner reference with
// the set's UID), oldest first.
func SetPods(set *v1alpha1.ExporterSet, pods []corev1.Pod) []corev1.Pod {
	var out []corev1.Pod
	for i := range pods {
		if ref := metav1.GetControllerOf(&pods[i]); ref != nil && ref.UID == set.UID {
			out = append(out, pods[i])
		}
	}
	slices.SortStableFunc(out, func(a, b corev1.Pod) int {
		if c := a.CreationTimestamp.Compare(b.CreationTimestamp.Time); c != 0 {
			return c
		}
		return strings.Compare(a.Name, b.Name)
	})
	return out
}

// Claimable returns the Free pods among pods, oldest first.
func Claimable(pods []corev1.Pod, now time.Time) []corev1.Pod {
	var out []corev1.Pod
	for i := range pods {
		if Classify(&pods[i], now) == Free {
			out = append(out, pods[i])
		}
	}
	return out
}

// ClaimPatch is the JSON merge patch that claims a pod read at
// resourceVersion rv for holder: the lease label, the used mark, the
// lease start and, when d > 0, the expiry now+d (an absent d removes any
// expiry). The API server refuses it with Conflict when the pod changed
// since rv, so of two clients claiming the same pod exactly one wins.
func ClaimPatch(rv, holder string, now time.Time, d time.Duration) []byte {
	expires := "null"
	if d > 0 {
		expires = fmt.Sprintf("%q", now.Add(d).UTC().Format(time.RFC3339))
	}
	return fmt.Appendf(nil, `{"metadata":{"resourceVersion":%q,"labels":{%q:%q,%q:"true"},"annotations":{%q:%q,%q:%s}}}`,
		rv, v1alpha1.LeaseLabel, holder, v1alpha1.UsedLabel,
		v1alpha1.LeasedAtAnnotation, now.UTC().Format(time.RFC3339), v1alpha1.LeaseExpiresAnnotation, expires)
}

// ReleasePatch is the JSON merge patch that ends the lease of a pod read at
// resourceVersion rv: the lease label and annotations go, the used mark
// stays (the controller recycles the pod by the set's recyclePolicy).
func ReleasePatch(rv string) []byte {
	return fmt.Appendf(nil, `{"metadata":{"resourceVersion":%q,"labels":{%q:null},"annotations":{%q:null,%q:null}}}`,
		rv, v1alpha1.LeaseLabel, v1alpha1.LeasedAtAnnotation, v1alpha1.LeaseExpiresAnnotation)
}

// ValidateHolder checks that h can be the value of the lease label.
func ValidateHolder(h string) error {
	if h == "" {
		return fmt.Errorf("holder must not be empty: give --holder NAME")
	}
	if errs := validation.IsValidLabelValue(h); len(errs) > 0 {
		return fmt.Errorf("holder %q cannot be the value of label %s: %s", h, v1alpha1.LeaseLabel, strings.Join(errs, "; "))
	}
	return nil
}

// DefaultHolder names the holder after the user and the host,
// "user.host", made a valid label value: other characters become '-', at
// most 63 characters, alphanumeric at both ends. It returns "" when
// nothing usable is left.
func DefaultHolder(user, host string) string {
	host, _, _ = strings.Cut(host, ".") // the short host name
	s := user
	if host != "" {
		if s != "" {
			s += "."
		}
		s += host
	}
	b := []byte(s)
	for i, c := range b {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.') {
			b[i] = '-'
		}
	}
	s = string(b)
	if len(s) > validation.LabelValueMaxLength {
		s = s[:validation.LabelValueMaxLength]
	}
	alnum := func(r rune) bool { return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9') }
	return strings.TrimFunc(s, alnum)
}

// ValidateDuration checks a --for value: at least a second (the expiry has
// second resolution).
func ValidateDuration(d time.Duration) error {
	if d < time.Second {
		return fmt.Errorf("--for %s: a lease lasts at least 1s (or give no --for: until released)", d)
	}
	return nil
}
