package controller

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"fmt"
	"io"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
)

// The guest login a pod's exporter Secret carries (keys username and
// password; the node seeds it into the guest and the exporter answers
// get_username and get_password with it): the set's named login
// (spec.jumpstarter.guestLoginSecretName), else, unless the set's
// defaultGuestLogin is None, one generated for the pod. A generated login
// lives only in the pod's exporter Secret, which the pod owns: it is
// never logged, never in an event or status, and goes with the pod. The
// controller writes it, as it writes the rest of that Secret, while the
// pod waits at its scheduling gate: no node has read the Secret yet, so a
// second write (a retry) may generate a new one.

// generatedPasswordBytes is the entropy of a generated password (192 bits,
// 32 characters of URL-safe base64).
const generatedPasswordBytes = 24

// generatesLogin says whether pod of a set gets a generated login: the set
// names no login Secret and does not switch the default off, and the pod
// does not start from memory snapshots (their guests booted once for
// every pod of the snapshot: per-pod data stays out of them, and a seed
// disk would keep the VM from snapshot starts). Pure.
func generatesLogin(js *v1alpha1.JumpstarterSpec, pod *corev1.Pod) bool {
	return js.GuestLoginSecretName == "" && js.DefaultGuestLogin != v1alpha1.DefaultGuestLoginNone &&
		pod.Annotations[v1alpha1.StartFromSnapshotAnnotation] != "true"
}

// generatePassword reads a password from random (crypto/rand's Reader in
// production): URL-safe base64, which chpasswd and ssh take as is.
func generatePassword(random io.Reader) (string, error) {
	b := make([]byte, generatedPasswordBytes)
	if _, err := io.ReadFull(random, b); err != nil {
		return "", fmt.Errorf("generate a guest password: %w", err)
	}
	return base64.RawURLEncoding.EncodeToString(b), nil
}

// guestLogin is the login of pod p of set: nil, nil with no login; a
// reason ("" when it could) when the pod must wait.
func (r jsClient) guestLogin(ctx context.Context, set jsTarget, p *corev1.Pod) (user, pass []byte, reason string) {
	if generatesLogin(set.Spec, p) {
		p, err := generatePassword(rand.Reader)
		if err != nil {
			return nil, nil, err.Error()
		}
		return []byte(v1alpha1.GeneratedGuestLoginUser), []byte(p), ""
	}
	ln := set.Spec.GuestLoginSecretName
	if ln == "" {
		return nil, nil, "" // defaultGuestLogin None, or a snapshot start
	}
	var login corev1.Secret
	if err := r.Reader.Get(ctx, types.NamespacedName{Namespace: p.Namespace, Name: ln}, &login); err != nil {
		if apierrors.IsNotFound(err) {
			return nil, nil, fmt.Sprintf("guest login Secret %s (spec.jumpstarter.guestLoginSecretName) not found", ln)
		}
		return nil, nil, fmt.Sprintf("reading guest login Secret %s failed: %v", ln, err)
	}
	user, pass = login.Data[v1alpha1.JumpstarterSecretUsername], login.Data[v1alpha1.JumpstarterSecretPassword]
	if len(user) == 0 || len(pass) == 0 {
		return nil, nil, fmt.Sprintf("guest login Secret %s (spec.jumpstarter.guestLoginSecretName) needs keys %s and %s", ln, v1alpha1.JumpstarterSecretUsername, v1alpha1.JumpstarterSecretPassword)
	}
	return user, pass, ""
}
