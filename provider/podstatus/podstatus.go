package podstatus

import (
	"fmt"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Container state reasons, as a kubelet reports them.
const (
	ReasonContainerCreating = "ContainerCreating"
	ReasonErrImagePull      = "ErrImagePull"
	ReasonImagePullBackOff  = "ImagePullBackOff"
	ReasonCrashLoopBackOff  = "CrashLoopBackOff"
	ReasonCompleted         = "Completed"
	ReasonError             = "Error"
	// ReasonGuestPanicked: the guest kernel panicked (pvpanic).
	ReasonGuestPanicked = "GuestPanicked"
	// ReasonStartError: QEMU could not be started (bad disk, bad spec...).
	ReasonStartError = "StartError"
	// ReasonInvalidVMSpec: the pod translated, but the VM spec it gives with
	// this image is invalid (e.g. memory below QEMU's minimum).
	ReasonInvalidVMSpec = "InvalidVMSpec"
	// ReasonPoweredOff: the VM was powered off on request (Jumpstarter
	// power off) and waits to be powered on.
	ReasonPoweredOff = "PoweredOff"
)

// ContainerIDPrefix is the scheme of container IDs ("qemu://<pod uid>").
const ContainerIDPrefix = "qemu://"

// VMState is the plain-data state of a pod's VM (its one container), as
// recorded in the pod's state dir (status.json) and turned into a
// PodStatus by PodStatus. Times are UTC.
type VMState struct {
	// StartTime is when the pod was admitted.
	StartTime time.Time `json:"startTime"`
	// Rejection is set when the pod was not admitted (phase Failed).
	Rejection *podspec.Rejection `json:"rejection,omitempty"`
	// Exactly one of Waiting, Running, Terminated is set.
	Waiting    *corev1.ContainerStateWaiting    `json:"waiting,omitempty"`
	Running    *corev1.ContainerStateRunning    `json:"running,omitempty"`
	Terminated *corev1.ContainerStateTerminated `json:"terminated,omitempty"`
	// LastTerminated is the previous run's end (restarts).
	LastTerminated *corev1.ContainerStateTerminated `json:"lastTerminated,omitempty"`
	RestartCount   int32                            `json:"restartCount"`
	// ImageID is "<repo>@<digest>" once pulled.
	ImageID string `json:"imageID,omitempty"`
	// ImageDigest is the digest held (oci.Store.Acquire) while the pod lives.
	ImageDigest string `json:"imageDigest,omitempty"`
	// Final is true when the VM will not run again (phase Succeeded/Failed).
	Final bool `json:"final,omitempty"`
	// Started is true once a VM was started for this pod at least once.
	Started bool `json:"started,omitempty"`
	// PoweredOff: the VM was powered off on request (the pod's Jumpstarter
	// exporter) and stays off, whatever the restart policy, until powered
	// on. The container shows Waiting/PoweredOff with the run's end as its
	// last termination state; restartCount is unchanged.
	PoweredOff bool `json:"poweredOff,omitempty"`
	// FlashedImage is the image the VM boots instead of the pod's (a
	// Jumpstarter flash), as repo@digest; it survives VM and agent restarts
	// and lasts as long as the pod.
	FlashedImage string `json:"flashedImage,omitempty"`
	// Flashed are the partitions flashed from files (root, bios,
	// OVMF_CODE.fd, OVMF_VARS.fd; provider/exporter/flash.go): the VM boots them
	// from then on, across VM and agent restarts, as long as the pod lives.
	Flashed map[string]FlashedPartition `json:"flashed,omitempty"`
	// Size is the memory and disk size asked through the pod's
	// Jumpstarter exporter (set_memory_size, set_disk_size; provider/exporter/vmsize.go),
	// applied at every VM start from then on; nil: the pod's own.
	Size *VMSize `json:"size,omitempty"`
}

// FlashedPartition is one partition flashed from a file (VMState.Flashed).
type FlashedPartition struct {
	// File is the partition's file in the pod's flash dir.
	File string `json:"file"`
	// Digest is sha256:<hex> of the content as flashed; Size its length.
	Digest string `json:"digest"`
	Size   int64  `json:"size"`
	// Format is what qemu-img found: raw or qcow2.
	Format string `json:"format"`
}

// Waiting sets a waiting state.
func (s *VMState) SetWaiting(reason, msg string) {
	s.Waiting, s.Running, s.Terminated = &corev1.ContainerStateWaiting{Reason: reason, Message: msg}, nil, nil
}

// SetRunning records a started VM.
func (s *VMState) SetRunning(at time.Time) {
	s.Waiting, s.Running, s.Terminated = nil, &corev1.ContainerStateRunning{StartedAt: metav1.NewTime(at.UTC())}, nil
	s.Started = true
}

// SetTerminated records how the VM ended.
func (s *VMState) SetTerminated(t corev1.ContainerStateTerminated) {
	s.Waiting, s.Running, s.Terminated = nil, nil, &t
}

// TerminatedFromExit maps a qemu.Exit to the container's terminated state:
// exit 0 is Completed, a guest panic GuestPanicked, anything else Error;
// the message is the exit's reason.
func TerminatedFromExit(ex qemu.Exit, started time.Time, containerID string) corev1.ContainerStateTerminated {
	reason := ReasonError
	switch {
	case ex.ExitCode == 0:
		reason = ReasonCompleted
	case ex.Class == qemu.ExitPanicked:
		reason = ReasonGuestPanicked
	}
	at := ex.At
	if at.IsZero() {
		at = time.Now()
	}
	return corev1.ContainerStateTerminated{
		ExitCode:    int32(ex.ExitCode),
		Reason:      reason,
		Message:     ex.Reason,
		StartedAt:   metav1.NewTime(started.UTC()),
		FinishedAt:  metav1.NewTime(at.UTC()),
		ContainerID: containerID,
	}
}

// RestartDecision says whether a VM that ended restarts, per restartPolicy
// (the kubelet's rules for one container).
func RestartDecision(policy corev1.RestartPolicy, exitCode int32) bool {
	switch policy {
	case corev1.RestartPolicyNever:
		return false
	case corev1.RestartPolicyOnFailure:
		return exitCode != 0
	default: // Always, or unset
		return true
	}
}

// Backoff is the kubelet's exponential back-off: Initial, doubling up to
// Max.
type Backoff struct {
	Initial, Max time.Duration
}

// DefaultBackoff is the kubelet's: 10s doubling to 5m, for image pulls and
// crash loops.
var DefaultBackoff = Backoff{Initial: 10 * time.Second, Max: 5 * time.Minute}

// Delay is the wait after the n-th consecutive failure (n >= 1).
func (b Backoff) Delay(n int) time.Duration {
	if n < 1 {
		return 0
	}
	d := b.Initial
	for i := 1; i < n; i++ {
		d *= 2
		if d >= b.Max {
			return b.Max
		}
	}
	if d > b.Max {
		return b.Max
	}
	return d
}

// CrashLoopResetAfter: a VM that ran at least this long resets the crash
// loop back-off (the kubelet forgets back-off entries after twice the
// maximum back-off).
const CrashLoopResetAfter = 10 * time.Minute

// RestartDelay is the wait before restarting a VM after its n-th
// consecutive exit: the first restart is immediate, then the back-off
// (10s, 20s, ... 5m), as the kubelet does.
func (b Backoff) RestartDelay(n int) time.Duration {
	if n <= 1 {
		return 0
	}
	return b.Delay(n - 1)
}

// PodStatus computes the pod's status from the VM state. pod is the pod as
// bound (its spec, and status fields owned by others such as qosClass);
// nodeIP is the pod and host IP (user-mode networking: podIP = host IP).
// Pure.
func PodStatus(pod *corev1.Pod, st VMState, nodeIP string, now time.Time) corev1.PodStatus {
	start := metav1.NewTime(st.StartTime.UTC())
	if st.StartTime.IsZero() {
		start = metav1.NewTime(now.UTC())
	}
	out := corev1.PodStatus{
		QOSClass:  pod.Status.QOSClass,
		StartTime: &start,
	}
	if nodeIP != "" {
		out.HostIP = nodeIP
		out.HostIPs = []corev1.HostIP{{IP: nodeIP}}
		out.PodIP = nodeIP
		out.PodIPs = []corev1.PodIP{{IP: nodeIP}}
	}
	cond := func(t corev1.PodConditionType, ok bool, reason, msg string) corev1.PodCondition {
		c := corev1.PodCondition{Type: t, Status: corev1.ConditionTrue, LastTransitionTime: start}
		if !ok {
			c.Status, c.Reason, c.Message = corev1.ConditionFalse, reason, msg
		}
		return c
	}
	image := ""
	name := "vm"
	if len(pod.Spec.Containers) > 0 {
		image, name = pod.Spec.Containers[0].Image, pod.Spec.Containers[0].Name
	}

	if r := st.Rejection; r != nil {
		out.Phase, out.Reason, out.Message = corev1.PodFailed, r.Reason, r.Message
		out.Conditions = []corev1.PodCondition{
			cond(corev1.PodScheduled, true, "", ""),
			cond(corev1.PodInitialized, false, r.Reason, r.Message),
			cond(corev1.ContainersReady, false, r.Reason, r.Message),
			cond(corev1.PodReady, false, r.Reason, r.Message),
		}
		term := &corev1.ContainerStateTerminated{ExitCode: 128, Reason: r.Reason, Message: r.Message, FinishedAt: start}
		for _, c := range pod.Spec.InitContainers {
			out.InitContainerStatuses = append(out.InitContainerStatuses, corev1.ContainerStatus{Name: c.Name, Image: c.Image, State: corev1.ContainerState{Terminated: term.DeepCopy()}})
		}
		for _, c := range pod.Spec.Containers {
			out.ContainerStatuses = append(out.ContainerStatuses, corev1.ContainerStatus{Name: c.Name, Image: c.Image, State: corev1.ContainerState{Terminated: term.DeepCopy()}})
		}
		return out
	}

	running := st.Running != nil
	cs := corev1.ContainerStatus{
		Name:         name,
		Image:        image,
		ImageID:      st.ImageID,
		Ready:        running,
		Started:      &running,
		RestartCount: st.RestartCount,
	}
	if st.Started {
		cs.ContainerID = ContainerIDPrefix + string(pod.UID)
	}
	switch {
	case st.Running != nil:
		cs.State.Running = st.Running.DeepCopy()
	case st.Terminated != nil:
		cs.State.Terminated = st.Terminated.DeepCopy()
	case st.Waiting != nil:
		cs.State.Waiting = st.Waiting.DeepCopy()
	default:
		cs.State.Waiting = &corev1.ContainerStateWaiting{Reason: ReasonContainerCreating}
	}
	if st.LastTerminated != nil {
		cs.LastTerminationState.Terminated = st.LastTerminated.DeepCopy()
	}
	out.ContainerStatuses = []corev1.ContainerStatus{cs}

	switch {
	case st.Final && st.Terminated != nil && st.Terminated.ExitCode == 0:
		out.Phase = corev1.PodSucceeded
	case st.Final:
		out.Phase = corev1.PodFailed
	case running || st.RestartCount > 0 || st.LastTerminated != nil || st.Terminated != nil:
		out.Phase = corev1.PodRunning
	default:
		out.Phase = corev1.PodPending
	}
	notReady := "containers with unready status: [" + name + "]"
	reason := "ContainersNotReady"
	if st.Final {
		reason = "PodCompleted"
		notReady = ""
	}
	out.Conditions = []corev1.PodCondition{
		cond(corev1.PodReadyToStartContainers, true, "", ""),
		cond(corev1.PodInitialized, true, "", ""),
		cond(corev1.ContainersReady, running, reason, notReady),
		cond(corev1.PodReady, running, reason, notReady),
		cond(corev1.PodScheduled, true, "", ""),
	}
	if running {
		t := metav1.NewTime(st.Running.StartedAt.Time)
		out.Conditions[2].LastTransitionTime, out.Conditions[3].LastTransitionTime = t, t
	}
	return out
}

// PullBackOffMessage is the ImagePullBackOff message, as the kubelet words it.
func PullBackOffMessage(image, lastErr string) string {
	return fmt.Sprintf("Back-off pulling image %q: %s: %s", image, ReasonErrImagePull, lastErr)
}

// CrashLoopMessage is the CrashLoopBackOff message.
func CrashLoopMessage(d time.Duration, name string, uid string) string {
	return fmt.Sprintf("back-off %s restarting failed container=%s pod=%s", d.Round(time.Second), name, uid)
}

func MetaTime(t time.Time) metav1.Time { return metav1.NewTime(t.UTC()) }

// DeleteGrace is the grace period of a pod's deletion as the node sees it
// when it is asked to delete: the deletion's own period
// (deletionGracePeriodSeconds), else the spec's, else def. As for a kubelet,
// the period counts from when the node acts, not from the deletion
// request: virtual-kubelet removes the pod that period after it hands the
// deletion to the node, so a node that acts late (an agent restarted, a host
// back from a partition) still gives the guest its whole ACPI budget.
func DeleteGrace(pod *corev1.Pod, def time.Duration) time.Duration {
	switch {
	case pod.DeletionGracePeriodSeconds != nil:
		return time.Duration(*pod.DeletionGracePeriodSeconds) * time.Second
	case pod.Spec.TerminationGracePeriodSeconds != nil:
		return time.Duration(*pod.Spec.TerminationGracePeriodSeconds) * time.Second
	}
	return def
}

// QuitGrace is how long QEMU gets to quit (QMP quit) after a guest's ACPI
// budget, before it is killed.
const QuitGrace = 2 * time.Second

// ACPIBudget is how long a deleted pod's guest gets after the ACPI power
// button, out of its grace period: the rest (a tenth, between QuitGrace+1s
// and 5s) is kept for quitting or killing QEMU and then writing the terminal
// status before the grace deadline, when virtual-kubelet deletes the pod
// whatever its status. At least 1s.
func ACPIBudget(grace time.Duration) time.Duration {
	margin := min(max(grace/10, QuitGrace+time.Second), 5*time.Second)
	return max(grace-margin, time.Second)
}

// Ready reports whether pod's Ready condition is True.
func Ready(pod *corev1.Pod) bool {
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}
