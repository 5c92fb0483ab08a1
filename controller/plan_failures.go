package controller

import (
	"fmt"
	"sort"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
)

// The failure steps of Plan: finished pods and pods failing to start go
// (step 1), the failure count and backoff follow (step 4), and the
// ReplicaFailure condition reports them.

// Backoff of replacements for failed pods: the first replacement is
// immediate, then failureBackoffBase doubling up to failureBackoffMax.
const (
	failureBackoffBase = 10 * time.Second
	failureBackoffMax  = 5 * time.Minute
	// failureThreshold consecutive failed pods make ReplicaFailure True.
	failureThreshold = 3
	// stableReady is how long a pod created after the last failure must
	// have been Ready for starts to count as working again (the failure
	// count resets). A VM pod without a readiness probe is Ready while its
	// QEMU runs, so a guest that crashes during boot is Ready for its boot
	// time, which under TCG on a busy host is tens of seconds: that must
	// not reset the backoff. (A kubelet waits 10 min before it forgets a
	// container's crash loop; a minute suits VMs that are recycled often.)
	stableReady = time.Minute
)

// autohealReasons are the container waiting reasons under which autohealing
// may replace a pod: the VM itself fails to start (a fresh pod gets a fresh
// disk, maybe another node). Image pull and config errors are not among
// them: a fresh pod would pull the same image and miss the same Secret.
var autohealReasons = map[string]bool{
	"CrashLoopBackOff":     true,
	"CreateContainerError": true,
	"RunContainerError":    true,
	"StartError":           true,
}

// startFailureReasons are container waiting reasons that mean the pod cannot
// start on its own soon; they surface as ReplicaFailure. The pod is left to
// its node's retry (no delete/recreate churn).
var startFailureReasons = map[string]bool{
	"ErrImagePull":               true,
	"ImagePullBackOff":           true,
	"InvalidImageName":           true,
	"ErrImageNeverPull":          true,
	"CrashLoopBackOff":           true,
	"CreateContainerConfigError": true,
	"CreateContainerError":       true,
	"RunContainerError":          true,
	"StartError":                 true,
}

// finishInput is what finishPods looks at.
type finishInput struct {
	Pods []PodState
	// Removed names the pods the removal step deletes.
	Removed map[string]bool
	// Autohealing, when set, replaces pods whose VM keeps failing to start
	// (nil while the set is paused).
	Autohealing *Autohealing
	Now         time.Time
}

// finishDecision is what finishPods decided.
type finishDecision struct {
	// Delete: pods that ended (ReasonFailed) or fail to start
	// (ReasonFailingToStart).
	Delete []Deletion
	// Live are the pods that are neither terminating, removed nor deleted
	// here; a leased pod that ended is in neither Live nor Delete (its
	// holder sees the failure and releases it).
	Live []PodState
	// NewFailures counts the failed pods in Delete (a Succeeded pod is no
	// failure); LastFailed is the last of them, with why it failed.
	NewFailures int32
	LastFailed  *PodState
	// Requeue is when the next live pod may count as failing to start.
	Requeue time.Duration
}

// finishPods sorts the pods into live ones and ones that go because they
// ended (unless leased) or, with autohealing, keep failing to start.
func finishPods(in finishInput) finishDecision {
	var out finishDecision
	for _, p := range in.Pods {
		healAt := autohealAt(in.Autohealing, p)
		// A pod whose Exporter this controller disabled to let it go was
		// decided, and its failure counted, by an earlier pass: it only
		// waits for the drain now.
		counted := p.Exporter.draining()
		switch {
		case p.Terminating, in.Removed[p.Name]:
		case !healAt.IsZero() && !in.Now.Before(healAt):
			out.Delete = append(out.Delete, Deletion{PodRef: p.ref(), Reason: ReasonFailingToStart})
			if counted {
				continue
			}
			out.NewFailures++
			f := p
			f.FailedReason, f.FailedMessage = p.WaitingReason, fmt.Sprintf("restarted %d times, not Ready since %s: %s",
				p.RestartCount, p.notReadySince().UTC().Format(time.RFC3339), p.WaitingMessage)
			out.LastFailed = &f
		case p.Phase == corev1.PodFailed || p.Phase == corev1.PodSucceeded:
			if p.Leased {
				continue
			}
			out.Delete = append(out.Delete, Deletion{PodRef: p.ref(), Reason: ReasonFailed})
			if p.Phase == corev1.PodFailed && !counted {
				out.NewFailures++
				f := p
				out.LastFailed = &f
			}
		default:
			if !healAt.IsZero() {
				out.Requeue = soonest(out.Requeue, healAt.Sub(in.Now)) // look again when it may count
			}
			out.Live = append(out.Live, p)
		}
	}
	return out
}

// autohealAt is when p counts as failing to start (zero if it never will
// as it is now): autohealing on (a set), p not leased, waiting in an
// autoheal reason with at least the threshold of restarts; then the
// minimum duration after it stopped being Ready.
func autohealAt(a *Autohealing, p PodState) time.Time {
	if a == nil || p.Leased || p.Ready || p.Terminating || !autohealReasons[p.WaitingReason] || p.RestartCount < a.StartUpFailureThreshold {
		return time.Time{}
	}
	return p.notReadySince().Add(a.MinFailingToStartDuration)
}

// backoffInput is what backoff looks at.
type backoffInput struct {
	// Failures and LastFailure are the consecutive failures and the time
	// of the last one, as the previous status carried them.
	Failures    int32
	LastFailure *time.Time
	// NewFailures counts the pods that failed in this plan.
	NewFailures int32
	// Paused: new failures are not counted yet (the failed pods stay and
	// are counted once unpaused).
	Paused bool
	// Live are the live pods: one created after the last failure that
	// stayed Ready resets the count.
	Live []PodState
	Now  time.Time
}

// backoffDecision is what backoff decided.
type backoffDecision struct {
	// Failures and LastFailure are the new consecutive failures and time
	// of the last one.
	Failures    int32
	LastFailure *time.Time
	// Wait, when positive, is how long creates must still wait.
	Wait time.Duration
	// Requeue is when a Ready pod may have been Ready long enough to reset
	// the count.
	Requeue time.Duration
}

// backoff keeps the count of pods failed in a row and the backoff of
// creates that follows: none after the first failure, then
// failureBackoffBase doubling up to failureBackoffMax. A pod created after
// the last failure and Ready for stableReady shows that starts work again:
// the count resets.
func backoff(in backoffInput) backoffDecision {
	out := backoffDecision{Failures: in.Failures, LastFailure: in.LastFailure}
	if in.NewFailures > 0 && !in.Paused {
		out.Failures += in.NewFailures
		now := in.Now
		out.LastFailure = &now
	} else if out.Failures > 0 && out.LastFailure != nil {
		for _, p := range in.Live {
			if !p.Ready || !p.Created.After(*out.LastFailure) {
				continue
			}
			if stableAt := p.ReadySince.Add(stableReady); !p.ReadySince.IsZero() && in.Now.Before(stableAt) {
				out.Requeue = soonest(out.Requeue, stableAt.Sub(in.Now)) // look again once it may count
				continue
			}
			out.Failures = 0 // a pod started after the last failure and stayed Ready: starts work
			break
		}
	}
	if out.Failures > 1 && out.LastFailure != nil {
		d := failureBackoffBase << min(out.Failures-2, 16)
		d = min(d, failureBackoffMax)
		out.Wait = out.LastFailure.Add(d).Sub(in.Now)
	}
	return out
}

// failedInARow is in the message of a ReplicaFailure condition that reports
// repeated pod failures; lastDetail introduces the last failed pod's detail.
const failedInARow, lastDetail = " pods failed in a row", "; last: "

// IsRepeatedFailure reports whether c is a ReplicaFailure condition that
// Plan made for repeated pod failures (the one to pass as
// Input.LastFailure).
func IsRepeatedFailure(c *Condition) bool {
	return c != nil && c.Type == v1alpha1.ConditionReplicaFailure && c.Status == metav1.ConditionTrue &&
		strings.Contains(c.Message, failedInARow)
}

// replicaFailureInput is what replicaFailure looks at.
type replicaFailureInput struct {
	Live []PodState
	// Failures is the count of pods failed in a row (backoffDecision);
	// LastFailed the one that failed in this plan, if any.
	Failures   int32
	LastFailed *PodState
	// Prev is the last status's repeated-failure condition (Input.LastFailure).
	Prev *Condition
}

// replicaFailure is the ReplicaFailure condition: True while live pods
// wait in a reason that keeps them from starting, or after failureThreshold
// pods failed in a row.
func replicaFailure(in replicaFailureInput) Condition {
	var stuck []PodState
	for _, p := range in.Live {
		if startFailureReasons[p.WaitingReason] {
			stuck = append(stuck, p)
		}
	}
	if len(stuck) > 0 {
		sort.Slice(stuck, func(i, j int) bool { return stuck[i].Name < stuck[j].Name })
		p := stuck[0]
		return Condition{v1alpha1.ConditionReplicaFailure, metav1.ConditionTrue, p.WaitingReason,
			fmt.Sprintf("%d pods cannot start; pod %s: %s", len(stuck), p.Name, p.WaitingMessage)}
	}
	if in.Failures >= failureThreshold {
		reason, msg := "PodFailed", ""
		switch {
		case in.LastFailed != nil:
			if in.LastFailed.FailedReason != "" {
				reason = in.LastFailed.FailedReason
			}
			msg = fmt.Sprintf("%spod %s: %s", lastDetail, in.LastFailed.Name, in.LastFailed.FailedMessage)
		case IsRepeatedFailure(in.Prev):
			// No new failure in this pass (the failed pod is gone): keep the
			// last one's reason and detail rather than a generic one.
			reason = in.Prev.Reason
			if i := strings.Index(in.Prev.Message, lastDetail); i >= 0 {
				msg = in.Prev.Message[i:]
			}
		}
		return Condition{v1alpha1.ConditionReplicaFailure, metav1.ConditionTrue, reason,
			fmt.Sprintf("%d%s%s", in.Failures, failedInARow, msg)}
	}
	return Condition{v1alpha1.ConditionReplicaFailure, metav1.ConditionFalse, "NoFailures", "pods start"}
}
