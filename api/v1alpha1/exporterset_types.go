package v1alpha1

import (
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
)

// Well-known label keys and condition types of ExporterSets.
const (
	// LeaseLabel marks a pod as leased. Its value names the holder. A client
	// claims a Ready, unleased pod by adding it (see docs/exporterset.md) and
	// releases the pod by removing the label or deleting the pod.
	LeaseLabel = "qemu-kubelet.io/leased-by"
	// UsedLabel is the durable mark a claim leaves behind: a pod that carries
	// it without LeaseLabel has been leased and released. With the Replace
	// policy such a pod is deleted; with Reuse the controller removes the
	// mark and hands the pod out again.
	UsedLabel = "qemu-kubelet.io/used"
	// LeaseExpiresAnnotation, on a leased pod, is when the lease ends
	// (RFC 3339, e.g. 2026-01-02T15:04:05Z): from then on the controller
	// treats the pod as released (Replace: deleted; Reuse: lease label
	// removed, back in the buffer). `kubectl exs lease --for` sets it; a
	// holder extends the lease by overwriting it. Without it a lease lasts
	// until released.
	LeaseExpiresAnnotation = "qemu-kubelet.io/lease-expires-at"
	// LeasedAtAnnotation, on a leased pod, is when the lease began (RFC
	// 3339), for `kubectl exs list`. Informational only.
	LeasedAtAnnotation = "qemu-kubelet.io/leased-at"
	// TemplateHashLabel holds the hash of the pod template a pod was created
	// from; pods whose hash differs from the set's current one are rolled.
	TemplateHashLabel = "qemu-kubelet.io/template-hash"

	// ConditionAvailable is True when the set has at least its target number
	// of Ready pods and its warm buffer of Ready unleased pods.
	ConditionAvailable = "Available"
	// ConditionProgressing is True while pods are being created, deleted or
	// rolled towards the target.
	ConditionProgressing = "Progressing"
	// ConditionReplicaFailure is True when pods cannot be created or keep
	// failing to start; the reason names the failure (e.g. ImagePullBackOff).
	ConditionReplicaFailure = "ReplicaFailure"
	// ConditionExportersReady (Jumpstarter mode only) is True when every pod
	// of the set has its Exporter credential and left the scheduling gate;
	// False with reason WaitingForCredential names the gated pods.
	ConditionExportersReady = "ExportersReady"

	// JumpstarterGate is the scheduling gate a pod of a Jumpstarter-mode set
	// is created with; the controller removes it once the pod's exporter
	// Secret (JumpstarterSecretAnnotation) is written.
	JumpstarterGate = "qemu-kubelet.io/jumpstarter-credential"
	// ExporterSetLabel is on every Exporter a set owns; its value is the
	// set's name.
	ExporterSetLabel = "qemu-kubelet.io/exporterset"
	// ExporterPodLabel is on the Exporter of a pod; its value is the pod's
	// name (the Exporter has the same name). The set's cold exporter has
	// the value ExporterPodCold.
	ExporterPodLabel = "qemu-kubelet.io/exporter-pod"
	// ExporterPodCold is the ExporterPodLabel value of a set's cold
	// exporter: an enabled Exporter with no VM, which keeps a matching
	// Lease Pending (Offline) instead of Unsatisfiable while no pod exists.
	ExporterPodCold = "none"
	// ExporterDisabledAtAnnotation records (RFC 3339) when the controller
	// set spec.enabled=false on an Exporter it is about to delete; the
	// pod and Exporter go only after the drain delay has passed since.
	ExporterDisabledAtAnnotation = "qemu-kubelet.io/disabled-at"

	// RemoveAnnotation, set to "true" on a pod of a set, asks for that pod
	// to be removed: the controller deletes it (once it is not leased) and
	// lowers spec.replicas by one, whatever the scale-in policy. With
	// scaleInPolicy Explicit it is the only way the set scales in.
	RemoveAnnotation = "qemu-kubelet.io/remove"
	// RemovingAnnotation is on an ExporterSet: the UIDs (comma-separated)
	// of the pods whose removal (RemoveAnnotation) the controller has
	// already counted in spec.replicas. It is written in the same patch as
	// the lowered spec.replicas, so each removal lowers the count once.
	RemovingAnnotation = "qemu-kubelet.io/removing"
)

// ScaleInPolicy says which pods go when a set has more pods than its target.
// +kubebuilder:validation:Enum=Newest;Oldest;Explicit
type ScaleInPolicy string

const (
	// ScaleInNewest removes the newest pods first (the least invested).
	ScaleInNewest ScaleInPolicy = "Newest"
	// ScaleInOldest removes the oldest pods first.
	ScaleInOldest ScaleInPolicy = "Oldest"
	// ScaleInExplicit never chooses: only pods marked with RemoveAnnotation
	// go (and spec.replicas drops with each).
	ScaleInExplicit ScaleInPolicy = "Explicit"
)

// RecyclePolicy says what happens to a pod whose lease ended.
// +kubebuilder:validation:Enum=Replace;Reuse
type RecyclePolicy string

const (
	// RecyclePolicyReplace deletes a released pod; a fresh one refills the
	// buffer. A used pod is never handed out again.
	RecyclePolicyReplace RecyclePolicy = "Replace"
	// RecyclePolicyReuse returns a released pod to the warm buffer.
	RecyclePolicyReuse RecyclePolicy = "Reuse"
)

// ExporterSetSpec is the desired state of an ExporterSet.
//
// +kubebuilder:validation:XValidation:rule="!has(self.maxReplicas) || !has(self.minAvailable) || self.minAvailable <= self.maxReplicas",message="spec.minAvailable must not exceed spec.maxReplicas"
// +kubebuilder:validation:XValidation:rule="!has(self.maxReplicas) || !has(self.replicas) || self.replicas <= self.maxReplicas",message="spec.replicas must not exceed spec.maxReplicas"
type ExporterSetSpec struct {
	// Replicas is the baseline number of pods. The scale subresource
	// (kubectl scale, HPA, KEDA) sets this field. The controller keeps
	// max(replicas, leased + minAvailable) pods, capped by maxReplicas.
	// +optional
	// +kubebuilder:default=1
	// +kubebuilder:validation:Minimum=0
	Replicas *int32 `json:"replicas,omitempty"`

	// MinAvailable is the warm buffer: the number of unleased pods kept on top
	// of the leased ones, so that a lease is served at once by a booted pod.
	// +optional
	// +kubebuilder:default=0
	// +kubebuilder:validation:Minimum=0
	MinAvailable *int32 `json:"minAvailable,omitempty"`

	// MaxReplicas, when set, caps the number of pods the set creates, whatever
	// replicas and minAvailable ask for. Leased pods are never deleted to meet
	// it.
	// +optional
	// +kubebuilder:validation:Minimum=0
	MaxReplicas *int32 `json:"maxReplicas,omitempty"`

	// Selector selects the set's pods. It must match the template's labels
	// (the controller reports ReplicaFailure with reason InvalidSelector
	// otherwise) and cannot change after creation.
	// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="spec.selector is immutable"
	// +kubebuilder:validation:XValidation:rule="(has(self.matchLabels) && size(self.matchLabels) > 0) || (has(self.matchExpressions) && size(self.matchExpressions) > 0)",message="spec.selector must not be empty"
	Selector *metav1.LabelSelector `json:"selector"`

	// Template describes the pods the set creates. Changing it rolls the
	// set: unleased pods are replaced first, leased ones after release.
	Template corev1.PodTemplateSpec `json:"template"`

	// RecyclePolicy says what happens to a pod whose lease ended: Replace
	// (default) deletes it and a fresh pod refills the buffer; Reuse returns
	// it to the buffer.
	// +optional
	// +kubebuilder:default=Replace
	RecyclePolicy RecyclePolicy `json:"recyclePolicy,omitempty"`

	// ScaleDownCooldown is how long the set must have had more pods than its
	// target before unleased pods are deleted to scale down. It avoids
	// deleting warm pods that a burst of leases would need again. Replacing
	// released, failed or outdated pods does not wait for it.
	// +optional
	// +kubebuilder:default="30s"
	ScaleDownCooldown *metav1.Duration `json:"scaleDownCooldown,omitempty"`

	// Jumpstarter, when set, makes the set a pool of Jumpstarter exporters:
	// each pod gets an Exporter (jumpstarter.dev/v1alpha1) of the same
	// name, leases come from Jumpstarter (an Exporter's status.leaseRef)
	// instead of pod labels, and pending Leases that select the exporter
	// labels make the set grow. See docs/exporterset.md.
	// +optional
	Jumpstarter *JumpstarterSpec `json:"jumpstarter,omitempty"`

	// ClassName names a VirtualTargetClass of the set's namespace whose
	// parameters, scheduling and pod defaults, binding mode, reclaim policy
	// and Jumpstarter defaults the set takes (the set's own values win).
	// A class that does not exist stops the set (ReplicaFailure
	// ClassNotFound); a class change rolls the pods like a template
	// change when it changes what the pods get.
	// +optional
	// +kubebuilder:validation:MaxLength=253
	ClassName string `json:"className,omitempty"`

	// StatePolicy says whether a pod's disk survives the restarts of its
	// VM: Disabled (a fresh disk over the image at every VM start) or
	// Retain (restarts, guest reboots, node agent restarts and, with
	// recyclePolicy Reuse, leases keep the disk; it goes with the pod
	// unless the class's reclaimPolicy is Retain). Unset: the class's
	// statePolicy, else Disabled. Pods with Retain carry the annotation
	// qemu-kubelet.io/state-policy=Retain; a change rolls the set.
	// +optional
	StatePolicy StatePolicy `json:"statePolicy,omitempty"`

	// Parameters are deep-merged over the class's parameters (objects merge
	// key by key, recursively; lists and scalars replace; null removes a
	// key of the class). The merged object reaches each pod as the
	// annotation qemu-kubelet.io/parameters and the guest as the
	// environment variable QK_PARAMETERS (environment disk), and is shown
	// in status.parameters.
	// +optional
	// +kubebuilder:pruning:PreserveUnknownFields
	// +kubebuilder:validation:Type=object
	Parameters *runtime.RawExtension `json:"parameters,omitempty"`

	// ScaleInPolicy says which unleased pods go when the set has more pods
	// than its target: Newest (default), Oldest, or Explicit (only pods
	// marked with the annotation qemu-kubelet.io/remove=true go, and
	// spec.replicas drops with each). Under every policy not-Ready pods go
	// before Ready ones, leased pods never, and a marked pod is removed
	// with spec.replicas lowered by one.
	// +optional
	// +kubebuilder:default=Newest
	ScaleInPolicy ScaleInPolicy `json:"scaleInPolicy,omitempty"`

	// Paused stops all scaling: no pod is created or deleted (nor Exporter
	// enabled or disabled) while it is true. The status is still
	// observed; the Progressing condition is Unknown with reason Paused
	// and says what the set would do.
	// +optional
	Paused bool `json:"paused,omitempty"`

	// Autohealing, when set, replaces pods whose VM keeps failing to start
	// (see AutohealingSpec). Without it such pods are left to their node's
	// restarts and reported in ReplicaFailure.
	// +optional
	Autohealing *AutohealingSpec `json:"autohealing,omitempty"`
}

// AutohealingSpec says when a pod counts as failing to start and is
// replaced by a fresh one (the names follow KubeVirt's VirtualMachinePool).
// A pod counts as failing when it is not Ready, its VM container waits in
// CrashLoopBackOff (or RunContainerError, StartError, CreateContainerError),
// its restart count reached startUpFailureThreshold, and it has not been
// Ready for minFailingToStartDuration. Leased pods are never replaced.
// A replacement counts as a pod failure: replacements back off like those
// of failed pods.
type AutohealingSpec struct {
	// StartUpFailureThreshold is how many times the VM must have failed to
	// start (the container's restart count) before the pod counts as
	// failing.
	// +optional
	// +kubebuilder:default=3
	// +kubebuilder:validation:Minimum=1
	StartUpFailureThreshold *int32 `json:"startUpFailureThreshold,omitempty"`
	// MinFailingToStartDuration is how long the pod must have been not
	// Ready (since its Ready condition last turned False, or since it was
	// created) before it counts as failing.
	// +optional
	// +kubebuilder:default="5m"
	MinFailingToStartDuration *metav1.Duration `json:"minFailingToStartDuration,omitempty"`
}

// DefaultGuestLogin is what guest login a pod of a Jumpstarter-mode set
// gets when the set names none.
// +kubebuilder:validation:Enum=Generate;None
type DefaultGuestLogin string

const (
	// DefaultGuestLoginGenerate: a login per pod, user
	// GeneratedGuestLoginUser with a random password (the default).
	DefaultGuestLoginGenerate DefaultGuestLogin = "Generate"
	// DefaultGuestLoginNone: no login.
	DefaultGuestLoginNone DefaultGuestLogin = "None"
)

// DriverSwitch turns a child driver that an exporter pod reports by
// default (as upstream's QEMU driver always has it) on or off.
// +kubebuilder:validation:Enum=Enabled;Disabled
type DriverSwitch string

const (
	// DriverEnabled: the driver is reported (the default).
	DriverEnabled DriverSwitch = "Enabled"
	// DriverDisabled: the driver is not reported.
	DriverDisabled DriverSwitch = "Disabled"
)

// SSHDriverAnnotation on a pod switches its exporter's default ssh child
// (a NetworkClient to the guest's TCP port 22) on or off: a DriverSwitch
// value, absent means Enabled. A container port named ssh replaces the
// default child whatever the annotation says. The ExporterSet controller
// sets it, to Disabled only, on the pods of a set whose
// spec.jumpstarter.sshDriver is Disabled.
const SSHDriverAnnotation = "qemu-kubelet.io/jumpstarter-ssh"

// DisplayAnnotation on a pod gives its VM a display or none: "vnc" (a
// graphics card and QEMU's VNC server, served as the exporter's vnc
// child) or DisplayNone. Absent, an exporter pod has one and any other pod
// none (the node's podspec.DisplayOf). The ExporterSet controller sets it,
// to DisplayNone only, on the pods of a set whose spec.jumpstarter.vncDriver
// is Disabled.
const DisplayAnnotation = "qemu-kubelet.io/display"

// DisplayNone is the DisplayAnnotation value of a VM without a display.
const DisplayNone = "none"

// GeneratedGuestLoginUser is the user of a generated guest login (the
// default user of upstream's QEMU driver).
const GeneratedGuestLoginUser = "jumpstarter"

// StartFromSnapshotAnnotation "true" on a pod starts its VM from a memory
// snapshot other pods of the same image and shape start from too (the
// node's podspec.AnnotationStartFromSnapshot). Such a pod holds no per-pod
// guest data, so it gets no generated guest login.
const StartFromSnapshotAnnotation = "qemu-kubelet.io/start-from-snapshot"

// JumpstarterSpec connects an ExporterSet to a Jumpstarter controller.
type JumpstarterSpec struct {
	// Endpoint is the Jumpstarter controller's gRPC endpoint (host:port)
	// written into each pod's exporter Secret. Empty means the endpoint
	// Jumpstarter reports in the Exporter's status.endpoint.
	// +optional
	// +kubebuilder:validation:MaxLength=253
	Endpoint string `json:"endpoint,omitempty"`

	// CABundle is a PEM bundle of the CA certificates that sign the
	// Jumpstarter controller's and router's TLS certificates; it is
	// written as ca.crt into each pod's exporter Secret. Empty means the
	// system roots.
	// +optional
	// +kubebuilder:validation:MaxLength=65536
	CABundle string `json:"caBundle,omitempty"`

	// ExporterLabels are the labels of every Exporter the set owns: the
	// labels Jumpstarter Leases select on. A pending Lease whose selector
	// matches them counts as demand for a pod of this set. They must not
	// use the qemu-kubelet.io/ prefix (the controller's own labels). They
	// are merged over the class's (spec.className); the result must not be
	// empty.
	// +optional
	// +kubebuilder:validation:MinProperties=1
	// +kubebuilder:validation:MaxProperties=32
	// +kubebuilder:validation:XValidation:rule="self.all(k, !k.startsWith('qemu-kubelet.io/'))",message="spec.jumpstarter.exporterLabels must not use the qemu-kubelet.io/ prefix"
	ExporterLabels map[string]string `json:"exporterLabels,omitempty"`

	// GuestLoginSecretName names a Secret in the set's namespace with keys
	// username and password: the guest login of every VM of the set. The
	// controller copies them into each pod's exporter Secret; the node
	// seeds the login into the guest through cloud-init (vendor-data) and
	// the exporter answers get_username and get_password with it, so
	// QemuClient.shell() logs in over the ssh driver. A pod waits behind its
	// scheduling gate until the Secret exists. Empty: the default guest
	// login (defaultGuestLogin).
	// +optional
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`
	GuestLoginSecretName string `json:"guestLoginSecretName,omitempty"`

	// DefaultGuestLogin is the guest login of a pod when
	// guestLoginSecretName is empty. Generate (the default, as upstream's
	// QEMU driver always has a login): each pod gets its own, user
	// jumpstarter with a random password, written into the pod's exporter
	// Secret (owned by the pod, so it goes with it) and used as a named
	// login is. None: no login (get_username and get_password answer
	// empty strings).
	// +optional
	DefaultGuestLogin DefaultGuestLogin `json:"defaultGuestLogin,omitempty"`

	// SSHDriver says whether each pod's exporter reports the ssh child
	// upstream's QEMU driver always has: a NetworkClient to the guest's TCP
	// port 22 (QemuClient.shell() logs in over it with the guest login).
	// Enabled (the default) or Disabled. A template container port named
	// ssh replaces the default child either way. Disabled reaches the pods
	// as the annotation qemu-kubelet.io/jumpstarter-ssh.
	// +optional
	SSHDriver DriverSwitch `json:"sshDriver,omitempty"`

	// VNCDriver says whether each pod's VM has a display and its exporter
	// the vnc child upstream's QEMU driver always has: a graphics card and
	// QEMU's VNC server on a unix socket on the node (QemuClient.novnc()
	// reaches it through the router). Enabled (the default) or Disabled.
	// Disabled reaches the pods as the annotation qemu-kubelet.io/display:
	// none, over the template's own.
	// +optional
	VNCDriver DriverSwitch `json:"vncDriver,omitempty"`

	// LeaseStatePolicy says what a lease leaves for the next one: Reset
	// (default) returns the target to what the set defines when a lease
	// ends (flashed image and firmware dropped, sizes undone, booted
	// again from the pod's image, powered on); Keep leaves it as the lease
	// left it. Unset: the class's, else Reset. Pods with Keep carry the
	// annotation qemu-kubelet.io/lease-state-policy=Keep, and so do the
	// pods of a set that does not recycle with Reuse (they are deleted
	// when their lease ends: nothing to reset).
	// +optional
	LeaseStatePolicy LeaseStatePolicy `json:"leaseStatePolicy,omitempty"`

	// Hooks are the exporter's lease hooks (beforeLease, afterLease), as
	// Jumpstarter's exporter config defines them, with VM actions for
	// scripts. Unset: the class's. They reach the pods as the annotation
	// qemu-kubelet.io/lease-hooks.
	// +optional
	Hooks *LeaseHooks `json:"hooks,omitempty"`
}

// ExporterSetStatus is the observed state of an ExporterSet.
type ExporterSetStatus struct {
	// Replicas is the number of pods the set owns that are neither
	// terminating nor finished. The scale subresource reads it.
	// +optional
	Replicas int32 `json:"replicas"`

	// DesiredReplicas is the effective target:
	// max(replicas, leased + pending leases + minAvailable), capped by
	// maxReplicas.
	// +optional
	DesiredReplicas int32 `json:"desiredReplicas"`

	// ReadyReplicas is the number of pods with a Ready condition.
	// +optional
	ReadyReplicas int32 `json:"readyReplicas"`

	// AvailableReplicas is the number of Ready pods that are not leased and
	// not waiting to be recycled: the warm buffer clients can claim.
	// +optional
	AvailableReplicas int32 `json:"availableReplicas"`

	// LeasedReplicas is the number of leased pods: pods that carry the lease
	// label, or in Jumpstarter mode pods whose Exporter holds a Lease.
	// +optional
	LeasedReplicas int32 `json:"leasedReplicas"`

	// PendingLeases (Jumpstarter mode) is the number of Jumpstarter Leases
	// waiting for an exporter of this set: not ended, no exporter assigned,
	// begin time reached, selector matching spec.jumpstarter.exporterLabels.
	// They count like leased pods towards the target.
	// +optional
	PendingLeases int32 `json:"pendingLeases"`

	// UpdatedReplicas is the number of pods created from the current template.
	// +optional
	UpdatedReplicas int32 `json:"updatedReplicas"`

	// Selector is the label selector of the pods in string form, for the
	// scale subresource (HPA).
	// +optional
	Selector string `json:"selector,omitempty"`

	// ObservedGeneration is the generation of the spec this status reflects.
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`

	// ScaleDownPendingSince is when the set first had more pods than its
	// target; scale-down happens once scaleDownCooldown has passed since.
	// +optional
	ScaleDownPendingSince *metav1.Time `json:"scaleDownPendingSince,omitempty"`

	// ConsecutiveFailures counts pods that failed since a pod last became
	// Ready; replacements of failed pods back off exponentially with it.
	// +optional
	ConsecutiveFailures int32 `json:"consecutiveFailures,omitempty"`

	// LastFailureTime is when a failed pod was last seen.
	// +optional
	LastFailureTime *metav1.Time `json:"lastFailureTime,omitempty"`

	// Class is the class the set resolved (spec.className) and the
	// effective values it took from it.
	// +optional
	Class *ClassStatus `json:"class,omitempty"`

	// Parameters are the set's effective parameters: the class's deep-merged
	// with the set's, as its pods get them.
	// +optional
	// +kubebuilder:pruning:PreserveUnknownFields
	// +kubebuilder:validation:Type=object
	Parameters *runtime.RawExtension `json:"parameters,omitempty"`

	// Conditions are Available, Progressing and ReplicaFailure, and in
	// Jumpstarter mode ExportersReady.
	// +optional
	// +listType=map
	// +listMapKey=type
	Conditions []metav1.Condition `json:"conditions,omitempty"`
}

// ClassStatus is what a set took from its VirtualTargetClass.
type ClassStatus struct {
	// Name of the class.
	Name string `json:"name"`
	// Generation of the class that was applied.
	// +optional
	Generation int64 `json:"generation,omitempty"`
	// BindingMode in effect.
	// +optional
	BindingMode BindingMode `json:"bindingMode,omitempty"`
	// ReclaimPolicy in effect.
	// +optional
	ReclaimPolicy ReclaimPolicy `json:"reclaimPolicy,omitempty"`
	// StatePolicy in effect (the set's, else the class's, else Disabled).
	// +optional
	StatePolicy StatePolicy `json:"statePolicy,omitempty"`
}

// The short name exs and the category all stay with this kind beside
// upstream Jumpstarter's ExporterSet (virtualtarget.jumpstarter.dev, same
// kind and plural, no short name): kubectl resolves a plain plural shared
// by two CRD groups to the alphabetically first group, this one, whatever
// the short names, so dropping exs would give upstream's users nothing and
// take from ours the one unambiguous short name. docs/exporterset.md
// ("Beside Jumpstarter's own ExporterSet API") says how to name each.

// ExporterSet keeps a number of pods (virtual test targets) and a warm buffer
// of Ready, unleased ones. Clients lease a pod by labelling it; the set grows
// to keep the buffer and recycles released pods.
//
// +kubebuilder:object:root=true
// +kubebuilder:resource:shortName=exs,categories=all
// +kubebuilder:subresource:status
// +kubebuilder:subresource:scale:specpath=.spec.replicas,statuspath=.status.replicas,selectorpath=.status.selector
// +kubebuilder:printcolumn:name="Desired",type=integer,JSONPath=`.status.desiredReplicas`,description="Effective target: max(replicas, leased + minAvailable), capped by maxReplicas"
// +kubebuilder:printcolumn:name="Current",type=integer,JSONPath=`.status.replicas`,description="Pods owned by the set"
// +kubebuilder:printcolumn:name="Ready",type=integer,JSONPath=`.status.readyReplicas`,description="Ready pods"
// +kubebuilder:printcolumn:name="Available",type=integer,JSONPath=`.status.availableReplicas`,description="Ready, unleased pods"
// +kubebuilder:printcolumn:name="Leased",type=integer,JSONPath=`.status.leasedReplicas`,description="Leased pods"
// +kubebuilder:printcolumn:name="Pending",type=integer,JSONPath=`.status.pendingLeases`,description="Jumpstarter Leases waiting for an exporter of the set"
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
// +kubebuilder:printcolumn:name="Class",type=string,JSONPath=`.spec.className`,priority=1,description="The VirtualTargetClass the set takes defaults from"
// +kubebuilder:printcolumn:name="ScaleIn",type=string,JSONPath=`.spec.scaleInPolicy`,priority=1,description="Which pods go on scale-in"
// +kubebuilder:printcolumn:name="Paused",type=boolean,JSONPath=`.spec.paused`,priority=1,description="Scaling stopped"
type ExporterSet struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// Spec is the desired state.
	Spec ExporterSetSpec `json:"spec"`
	// Status is the observed state, written by the controller.
	// +optional
	Status ExporterSetStatus `json:"status,omitempty"`
}

// ExporterSetList is a list of ExporterSets.
//
// +kubebuilder:object:root=true
type ExporterSetList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []ExporterSet `json:"items"`
}

func init() {
	SchemeBuilder.Register(&ExporterSet{}, &ExporterSetList{})
}

// The contract between a pod and the node's built-in Jumpstarter exporter:
// a pod opts in by naming, in JumpstarterSecretAnnotation, a Secret in its
// namespace holding these keys. The ExporterSet controller writes that
// Secret in Jumpstarter mode; anyone may write it by hand.
const (
	// JumpstarterSecretAnnotation names the pod's exporter Secret.
	JumpstarterSecretAnnotation = "qemu-kubelet.io/jumpstarter-exporter-secret"
	// JumpstarterSecretEndpoint is the controller's gRPC endpoint (host:port).
	JumpstarterSecretEndpoint = "endpoint"
	// JumpstarterSecretToken is the exporter's token (Exporter status.credential).
	JumpstarterSecretToken = "token"
	// JumpstarterSecretNamespace and JumpstarterSecretName identify the
	// Exporter object.
	JumpstarterSecretNamespace = "namespace"
	JumpstarterSecretName      = "name"
	// JumpstarterSecretCA is an optional PEM CA bundle for the controller
	// and router certificates.
	JumpstarterSecretCA = "ca.crt"
	// JumpstarterSecretUsername and JumpstarterSecretPassword, optional
	// (both or neither), are the guest login: the node seeds it into the
	// guest through cloud-init (vendor-data of the NoCloud seed) and the
	// exporter answers get_username and get_password with it, so
	// QemuClient.shell() logs in over the ssh driver.
	JumpstarterSecretUsername = "username"
	JumpstarterSecretPassword = "password"
	// JumpstarterSecretVolume is the name of the secret volume by which
	// the ExporterSet controller references a pod's exporter Secret: the
	// Node authorizer lets a node read only the Secrets its pods reference,
	// and the node keeps that volume on the host (never a guest disk).
	JumpstarterSecretVolume = "jumpstarter"
)
