package controller

import (
	"fmt"
	"maps"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	vtv1 "github.com/qemu-kubelet/qemu-kubelet/api/virtualtarget/v1alpha1"
)

// Upstream's ExporterSet (virtualtarget.jumpstarter.dev) mapped onto the
// planner's knobs and a VM pod template.

// Parameters of an upstream set or class this provisioner reads (merged:
// the set's over the class's). arch and resources.* are upstream's QEMU
// provisioner's; UpstreamImageParameter is ours.
const (
	// UpstreamImageParameter names an OCI image the VM boots
	// ({"qemuKubelet":{"image":"..."}}). Without it the VM boots an empty
	// root disk (v1alpha1.EmptyDiskImage) that the lease holder flashes,
	// upstream's model: its size is the Qemu driver's disk_size, else
	// resources.storage, else the class's ephemeral-storage, else
	// DefaultUpstreamStorage.
	UpstreamImageParameter = "qemuKubelet.image"
	upstreamArchParameter  = "arch"
)

// Reasons of the Degraded condition when an upstream set cannot be planned.
const (
	ReasonUpstreamClassNotFound = "ClassNotFound"
	// ReasonInvalidParameters (class.go) also serves upstream sets.
)

// DefaultUpstreamStorage is the empty root disk of a set with no image
// when neither its parameters, its Qemu driver nor its class size it.
var DefaultUpstreamStorage = resource.MustParse("10Gi")

// upstreamVMContainer is the name of the VM container of an upstream set's pods.
const upstreamVMContainer = "vm"

// UpstreamLabel is the label each pod of an upstream set carries: the set's
// name (pods are listed by it; the controller reference decides ownership).
const UpstreamLabel = "virtualtarget.qemu-kubelet.io/exporterset"

// virtualNodeSelector and virtualNodeToleration are what a pod needs to land
// on a virtual node when the class's scheduling says nothing (the chart's
// RuntimeClass and config/samples use the same).
var (
	virtualNodeSelector   = map[string]string{"type": "virtual-kubelet"}
	virtualNodeToleration = corev1.Toleration{Key: "virtual-kubelet.io/provider", Operator: corev1.TolerationOpEqual,
		Value: "qemu", Effect: corev1.TaintEffectNoSchedule}
)

// UpstreamSpec is an upstream set mapped onto this controller's terms.
type UpstreamSpec struct {
	// Knobs: Input with only the spec's fields set (Replicas, MinAvailable,
	// MaxReplicas, Recycle, Cooldown, Jumpstarter); the reconciler adds
	// what it observed.
	Knobs Input
	// Template is the VM pod the set's instances run.
	Template corev1.PodTemplateSpec
	// Parameters are the merged parameters, canonical JSON (nil if none).
	Parameters []byte
}

// MapUpstream maps an upstream set and its class onto planner knobs and a
// pod template. It is pure. class must be the set's class (the caller
// checked its provisioner); an error's Reason and Message are the set's
// Degraded condition.
func MapUpstream(set *vtv1.ExporterSet, class *vtv1.VirtualTargetClass, drainDelay time.Duration) (UpstreamSpec, *ClassError) {
	var out UpstreamSpec
	s := &set.Spec
	out.Knobs = Input{
		Replicas:     s.MinReplicas,
		MinAvailable: s.MinAvailableReplicas,
		Recycle:      v1alpha1.RecyclePolicyReplace,
		Cooldown:     5 * time.Minute, // the CRD's default
		Jumpstarter:  &JumpstarterInput{DrainDelay: drainDelay},
	}
	if n, bounded := s.Ceiling(); bounded {
		out.Knobs.MaxReplicas = &n
	}
	if s.RecycleStrategy == vtv1.RecycleStrategyInPlaceReuse {
		out.Knobs.Recycle = v1alpha1.RecyclePolicyReuse
	}
	if s.ScaleDownCooldown != nil {
		out.Knobs.Cooldown = s.ScaleDownCooldown.Duration
	}

	var base, over []byte
	if class.Spec.Parameters != nil {
		base = class.Spec.Parameters.Raw
	}
	if s.Parameters != nil {
		over = s.Parameters.Raw
	}
	merged, err := MergeParameters(base, over)
	if err != nil {
		return out, &ClassError{ReasonInvalidParameters, err.Error()}
	}
	out.Parameters = merged
	params, err := parseObject(merged, "the merged parameters")
	if err != nil { // MergeParameters wrote it: cannot happen
		return out, &ClassError{ReasonInvalidParameters, err.Error()}
	}
	t, cerr := upstreamTemplate(set, class.Spec.Scheduling, params)
	if cerr != nil {
		return out, cerr
	}
	if out.Knobs.Recycle != v1alpha1.RecyclePolicyReuse {
		// ExitAndReplace: the pod goes at lease end, nothing to reset.
		t.Annotations = map[string]string{v1alpha1.LeaseStatePolicyAnnotation: string(v1alpha1.LeaseStatePolicyKeep)}
	}
	out.Template = t
	return out, nil
}

// upstreamTemplate builds the VM pod template from the class's scheduling
// and the merged parameters.
func upstreamTemplate(set *vtv1.ExporterSet, sch *vtv1.SchedulingSpec, params map[string]any) (corev1.PodTemplateSpec, *ClassError) {
	var t corev1.PodTemplateSpec
	bad := func(format string, a ...any) *ClassError {
		return &ClassError{ReasonInvalidParameters, fmt.Sprintf(format, a...)}
	}
	image, err := paramString(params, UpstreamImageParameter)
	if err != nil {
		return t, bad("%v", err)
	}
	emptyDisk := image == ""
	if emptyDisk {
		image = v1alpha1.EmptyDiskImage // flashed during the lease (upstream's model)
	}
	drv, derr := MapDrivers(set.Spec.Template.Spec.Drivers)
	if derr != nil {
		return t, derr
	}
	c := corev1.Container{Name: upstreamVMContainer, Image: image, Ports: drv.Ports}
	if sch != nil && sch.Resources != nil {
		c.Resources = *sch.Resources.DeepCopy()
	}
	for _, r := range []struct {
		param  string
		name   corev1.ResourceName
		driver *resource.Quantity // the Qemu driver's setting, over the parameter
	}{{"resources.cpu", corev1.ResourceCPU, drv.CPU}, {"resources.memory", corev1.ResourceMemory, drv.Memory},
		{"resources.storage", corev1.ResourceEphemeralStorage, drv.Disk}} {
		q, err := paramQuantity(params, r.param)
		if err != nil {
			return t, bad("%v", err)
		}
		if r.driver != nil {
			q = r.driver
		}
		if q == nil {
			continue
		}
		// The parameter sizes the VM: its limit; the request too unless
		// the class's scheduling asks for less.
		if c.Resources.Limits == nil {
			c.Resources.Limits = corev1.ResourceList{}
		}
		c.Resources.Limits[r.name] = *q
		if _, ok := c.Resources.Requests[r.name]; !ok {
			if c.Resources.Requests == nil {
				c.Resources.Requests = corev1.ResourceList{}
			}
			c.Resources.Requests[r.name] = *q
		}
	}
	if emptyDisk {
		if cerr := sizeEmptyDisk(&c.Resources); cerr != nil {
			return t, cerr
		}
	}
	t.Spec.Containers = []corev1.Container{c}
	t.Spec.RestartPolicy = corev1.RestartPolicyNever // an instance that ends is replaced, never restarted in place
	if sch != nil && (len(sch.NodeSelector) > 0 || len(sch.Tolerations) > 0) {
		t.Spec.NodeSelector = maps.Clone(sch.NodeSelector)
		t.Spec.Tolerations = append([]corev1.Toleration(nil), sch.Tolerations...)
	} else {
		t.Spec.NodeSelector = maps.Clone(virtualNodeSelector)
		t.Spec.Tolerations = []corev1.Toleration{virtualNodeToleration}
	}
	arch, err := paramString(params, upstreamArchParameter)
	if err != nil {
		return t, bad("%v", err)
	}
	if drv.Arch != "" {
		if arch != "" && kubeArch[arch] != kubeArch[drv.Arch] {
			return t, &ClassError{ReasonUnsupportedDriver, fmt.Sprintf("the Qemu driver's arch %s differs from parameter arch %s", drv.Arch, arch)}
		}
		arch = drv.Arch
	}
	if arch != "" {
		k, ok := kubeArch[arch]
		if !ok {
			return t, bad("parameter arch %q: not an architecture of this provisioner (x86_64, amd64, aarch64, arm64)", arch)
		}
		if t.Spec.NodeSelector == nil {
			t.Spec.NodeSelector = map[string]string{}
		}
		t.Spec.NodeSelector[corev1.LabelArchStable] = k
	}
	t.Labels = map[string]string{UpstreamLabel: set.Name}
	return t, nil
}

// sizeEmptyDisk checks the size of the empty root disk of a set with no
// image (the container's ephemeral-storage limit, else its request, as
// the node reads it), or gives it DefaultUpstreamStorage when nothing
// sized it.
func sizeEmptyDisk(r *corev1.ResourceRequirements) *ClassError {
	q, ok := r.Limits[corev1.ResourceEphemeralStorage]
	if !ok {
		q, ok = r.Requests[corev1.ResourceEphemeralStorage]
	}
	if !ok {
		if r.Limits == nil {
			r.Limits = corev1.ResourceList{}
		}
		if r.Requests == nil {
			r.Requests = corev1.ResourceList{}
		}
		r.Limits[corev1.ResourceEphemeralStorage] = DefaultUpstreamStorage.DeepCopy()
		r.Requests[corev1.ResourceEphemeralStorage] = DefaultUpstreamStorage.DeepCopy()
		return nil
	}
	if err := v1alpha1.EmptyDiskSizeError(q); err != nil {
		return &ClassError{ReasonInvalidParameters, fmt.Sprintf("the empty root disk of a set with no parameter %s (sized by the Qemu driver's disk_size, "+
			"else resources.storage, else the class's ephemeral-storage): %v", UpstreamImageParameter, err)}
	}
	return nil
}

// kubeArch maps upstream's arch parameter (QEMU's names or Kubernetes')
// to the kubernetes.io/arch label of our virtual nodes.
var kubeArch = map[string]string{"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}

// paramLookup finds a dotted path in params; ok is false when a part is
// missing.
func paramLookup(params map[string]any, path string) (any, bool, error) {
	var cur any = params
	start := 0
	for i := 0; i <= len(path); i++ {
		if i < len(path) && path[i] != '.' {
			continue
		}
		m, isObj := cur.(map[string]any)
		if !isObj {
			return nil, false, fmt.Errorf("parameter %s: %s is %s, not an object", path, path[:start-1], jsonKind(cur))
		}
		v, ok := m[path[start:i]]
		if !ok {
			return nil, false, nil
		}
		cur, start = v, i+1
	}
	return cur, true, nil
}

func paramString(params map[string]any, path string) (string, error) {
	v, ok, err := paramLookup(params, path)
	if err != nil || !ok {
		return "", err
	}
	s, isStr := v.(string)
	if !isStr {
		return "", fmt.Errorf("parameter %s must be a string, not %s", path, jsonKind(v))
	}
	return s, nil
}

// paramQuantity reads a Kubernetes quantity ("2Gi", "1", 2).
func paramQuantity(params map[string]any, path string) (*resource.Quantity, error) {
	v, ok, err := paramLookup(params, path)
	if err != nil || !ok {
		return nil, err
	}
	s, ok := scalarText(v)
	if !ok {
		return nil, fmt.Errorf("parameter %s must be a quantity (such as \"2Gi\" or 2), not %s", path, jsonKind(v))
	}
	q, err := resource.ParseQuantity(s)
	if err != nil {
		return nil, fmt.Errorf("parameter %s: %q is not a quantity: %w", path, s, err)
	}
	if q.Sign() <= 0 {
		return nil, fmt.Errorf("parameter %s: %s must be positive", path, s)
	}
	return &q, nil
}
