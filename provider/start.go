package provider

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/provider/exporter"
	"github.com/qemu-kubelet/qemu-kubelet/provider/poddisk"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
)

// pullAndStart pulls the image (retrying with back-off, showing
// ErrImagePull / ImagePullBackOff) and starts the VM (then rec.vm). It is
// false when interrupted (delete, shutdown) or when the start failed
// (recorded as a terminated run). Each job is a step below: the run's plan, the pull, the
// image hold, the VM spec (vmSpec, pure: vmspec.go), readying what it
// names (waiting for its config: prepareRun), the QEMU start and the
// record of the started run.
func (r *podRun) pullAndStart(ctx context.Context) bool {
	p, rec := r.node, r.rec
	log := klog.FromContext(ctx)
	r.dropSnapshotClaim() // an earlier run's, unused
	pod, run := r.runPlan()
	plan := run.plan

	// Cancel the pull when the pod is deleted.
	pctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-rec.deleteReq:
			cancel()
		case <-pctx.Done():
		}
	}()
	att := p.cfg.Telemetry.BeginStart(pctx, rec.uid, pod, plan.Image) // telemetry/tracing.go: pod.start span, start metrics
	defer att.Done()

	img, ok := r.pullImage(pctx, pod, plan, att)
	if !ok {
		return false
	}
	r.holdImage(ctx, img)

	base, err := vmSpec(run, img, p.nodeVMSettings())
	spec := base
	if err == nil {
		pod, spec, ok, err = r.waitForSpec(ctx, pctx, pod, run, img, base)
		if !ok {
			return false
		}
	}
	att.Overlaid(err)
	if err != nil {
		reason := podstatus.ReasonStartError
		if _, ok := errors.AsType[podspec.InvalidSpec](err); ok {
			reason = podstatus.ReasonInvalidVMSpec
		}
		log.Error(err, "VM not started", "reason", reason)
		p.event(pod, corev1.EventTypeWarning, "Failed", err.Error())
		r.recordStartError(reason, err)
		return false
	}
	vm, spec, err := r.startQEMU(ctx, pctx, pod, run, img, base, spec)
	att.QEMUStarted(vm, err)
	if err != nil {
		if pctx.Err() != nil {
			return false
		}
		log.Error(err, "QEMU start failed")
		p.event(pod, corev1.EventTypeWarning, "Failed", "Error: "+err.Error())
		r.recordStartError(podstatus.ReasonStartError, err)
		return false
	}
	r.recordStarted(ctx, pod, vm, spec, run.size)
	return true
}

// runPlan is what this run boots (vmRun), read once from the record: the
// pod's plan with a flashed image applied, the size set through the
// exporter (exporter/vmsize.go) and the flashed firmware. It also forgets
// the previous run's snapshot use.
func (r *podRun) runPlan() (*corev1.Pod, vmRun) {
	rec := r.rec
	rec.snap.used, rec.snap.restoreFailed = nil, false
	pod, st := rec.read()
	run := vmRun{name: vmName(pod), dir: rec.dir, plan: rec.plan, flashed: st.Flashed}
	if st.FlashedImage != "" {
		// Flashed (package exporter): boot that image, pinned by digest.
		run.plan.Image, run.plan.PullPolicy = st.FlashedImage, oci.PullIfNotPresent
	}
	if st.Size != nil {
		run.size = *st.Size
	}
	return pod, run
}

// pullObserver sees each pull attempt (the start's telemetry).
type pullObserver interface {
	Pulled(t0 time.Time, err error)
}

// pullImage returns the image to boot: a flashed root or the pod's empty
// disk (package exporter: nothing pulled), the cached image when the pull
// policy allows it, else a pull retried with back-off (ErrImagePull, then
// ImagePullBackOff). ok is false when ctx ended (delete, shutdown).
func (r *podRun) pullImage(ctx context.Context, pod *corev1.Pod, plan podspec.Plan, att pullObserver) (img *oci.Image, ok bool) {
	p, rec := r.node, r.rec
	log := klog.FromContext(ctx)
	// A flashed root boots instead of any image; an empty-disk pod pulls
	// nothing (package exporter).
	img = exporter.OwnRoot(rec.dir, plan, rec.stateCopy())
	for attempt := 1; img == nil; attempt++ {
		t0 := time.Now()
		if img = p.presentImage(ctx, plan); img != nil {
			// As the kubelet: one Pulled event, no Pulling, for a cached image.
			att.Pulled(t0, nil)
			p.event(pod, corev1.EventTypeNormal, "Pulled", fmt.Sprintf("Container image %q already present on machine", plan.Image))
			break
		}
		auth := p.pullSecrets(ctx, pod, plan.PullSecrets)
		p.event(pod, corev1.EventTypeNormal, "Pulling", fmt.Sprintf("Pulling image %q", plan.Image))
		var err error
		img, err = p.cfg.Images.Pull(ctx, plan.Image, oci.PullOptions{Auth: auth, Policy: plan.PullPolicy})
		att.Pulled(t0, err)
		if err == nil {
			p.event(pod, corev1.EventTypeNormal, "Pulled", fmt.Sprintf("Successfully pulled image %q (%s) in %s", plan.Image, img.Digest, time.Since(t0).Round(time.Millisecond)))
			break
		}
		if ctx.Err() != nil {
			return nil, false
		}
		msg := err.Error()
		log.Info("Image pull failed", "image", plan.Image, "attempt", attempt, "err", msg)
		p.event(pod, corev1.EventTypeWarning, "Failed", fmt.Sprintf("Failed to pull image %q: %s", plan.Image, msg))
		r.update(func(st *podstatus.VMState) { st.SetWaiting(podstatus.ReasonErrImagePull, msg) })
		delay := p.cfg.Backoff.Delay(attempt)
		hold := min(p.cfg.ErrImagePullHold, delay)
		if !sleepCtx(ctx, hold) {
			return nil, false
		}
		r.update(func(st *podstatus.VMState) {
			st.SetWaiting(podstatus.ReasonImagePullBackOff, podstatus.PullBackOffMessage(plan.Image, msg))
		})
		p.event(pod, corev1.EventTypeNormal, "BackOff", fmt.Sprintf("Back-off pulling image %q", plan.Image))
		if !sleepCtx(ctx, delay-hold) {
			return nil, false
		}
	}
	return img, true
}

// holdImage holds img while the pod lives (the previous image's hold is
// given up) and records it as the pod's image: ContainerCreating.
func (r *podRun) holdImage(ctx context.Context, img *oci.Image) {
	p, rec := r.node, r.rec
	haveRelease := rec.release != nil && rec.stateCopy().ImageDigest == img.Digest
	if !haveRelease {
		r.releaseImage()
	}
	if !haveRelease && !exporter.IsFlashedRoot(img) && !exporter.IsEmptyDisk(img) {
		if rel, err := p.cfg.Images.Acquire(img.Digest); err == nil {
			rec.release = rel
		} else {
			klog.FromContext(ctx).Error(err, "Acquire image")
		}
	}
	r.update(func(st *podstatus.VMState) {
		st.ImageDigest = img.Digest
		st.ImageID = podspec.ImageID(img)
		st.SetWaiting(podstatus.ReasonContainerCreating, "")
	})
}

// waitForSpec readies what spec names (prepareRun), waiting with
// back-off while a Secret or ConfigMap it needs is missing
// (CreateContainerConfigError, as a kubelet: podspec.PrepareGuestDisks).
// It returns the pod as last read and prepareRun's result; ok is false
// when pctx ended while waiting.
func (r *podRun) waitForSpec(ctx, pctx context.Context, pod *corev1.Pod, run vmRun, img *oci.Image, spec qemu.Spec) (_ *corev1.Pod, _ qemu.Spec, ok bool, _ error) {
	p, rec := r.node, r.rec
	log := klog.FromContext(ctx)
	ready, err := r.prepareRun(ctx, pod, run, img, spec)
	for attempt := 1; err != nil && podspec.IsConfigError(err); attempt++ {
		msg := err.Error()
		log.Info("VM config not available", "err", msg)
		p.event(pod, corev1.EventTypeWarning, "Failed", "Error: "+msg)
		r.update(func(st *podstatus.VMState) { st.SetWaiting(podspec.ReasonCreateContainerConfigError, msg) })
		if !sleepCtx(pctx, min(p.cfg.Backoff.Delay(attempt), podspec.ConfigRetryMax)) {
			return pod, ready, false, err
		}
		pod = rec.podCopy()
		ready, err = r.prepareRun(ctx, pod, run, img, spec)
	}
	return pod, ready, true, err
}

// startQEMU starts the VM of ready (prepareRun's of spec), bounded by
// StartTimeout; a memory snapshot QEMU cannot load is discarded and the
// VM booted instead: spec readied again, without it (snapshots.go). It
// returns the spec that started.
func (r *podRun) startQEMU(ctx, pctx context.Context, pod *corev1.Pod, run vmRun, img *oci.Image, spec, ready qemu.Spec) (VM, qemu.Spec, error) {
	p, rec := r.node, r.rec
	sctx, scancel := context.WithTimeout(pctx, p.cfg.StartTimeout)
	vm, err := p.cfg.Hypervisor.Start(sctx, ready, rec.dir)
	scancel()
	if err != nil && ready.Incoming != "" && pctx.Err() == nil {
		// The snapshot cannot be loaded: discard it and boot (snapshots.go).
		r.restoreFailed(ctx, pod, err)
		ready, err = r.prepareRun(ctx, pod, run, img, spec)
		if err == nil {
			sctx, scancel := context.WithTimeout(pctx, p.cfg.StartTimeout)
			vm, err = p.cfg.Hypervisor.Start(sctx, ready, rec.dir)
			scancel()
		}
	}
	return vm, ready, err
}

// recordStartError records a start that failed as a terminated run (exit
// code 128, reason StartError or InvalidVMSpec).
func (r *podRun) recordStartError(reason string, err error) {
	p := r.node
	now := p.now()
	r.update(func(st *podstatus.VMState) {
		st.SetTerminated(corev1.ContainerStateTerminated{ExitCode: 128, Reason: reason, Message: err.Error(),
			StartedAt: podstatus.MetaTime(now), FinishedAt: podstatus.MetaTime(now)})
	})
}

// recordStarted records the started run: the pod's VM, the Started event,
// Running, and the size this run applied.
func (r *podRun) recordStarted(ctx context.Context, pod *corev1.Pod, vm VM, spec qemu.Spec, size podstatus.VMSize) {
	p, rec := r.node, r.rec
	rec.vm.set(vm) // before Running shows: the console, exec and the rest find it
	from := ""
	if spec.Incoming != "" {
		from = ", restored from a memory snapshot"
	}
	klog.FromContext(ctx).Info("VM started", "pid", vm.Pid(), "accelerator", spec.Accelerator, "fromSnapshot", spec.Incoming != "")
	p.event(pod, corev1.EventTypeNormal, "Started", fmt.Sprintf("Started VM (QEMU pid %d, %s, %d vCPU, %d MiB%s)", vm.Pid(), spec.Accelerator, spec.CPUs, spec.MemoryMiB, from))
	r.update(func(st *podstatus.VMState) {
		st.SetRunning(p.now())
		if st.Size != nil && (st.Size.AppliedMemoryBytes != size.MemoryBytes || st.Size.AppliedDiskBytes != size.DiskBytes) {
			st.Size.AppliedMemoryBytes, st.Size.AppliedDiskBytes = size.MemoryBytes, size.DiskBytes
			st.Size.Changed = p.now().UTC()
		}
	})
}

// presentImage returns the cached image of plan when its pull policy lets
// the node use it without asking the registry (IfNotPresent, Never), else
// nil. It never contacts a registry.
func (p *nodeWide) presentImage(ctx context.Context, plan podspec.Plan) *oci.Image {
	if plan.PullPolicy == oci.PullAlways {
		return nil
	}
	img, err := p.cfg.Images.Pull(ctx, plan.Image, oci.PullOptions{Policy: oci.PullNever})
	if err != nil {
		return nil
	}
	return img
}

// prepareRun readies what spec (vmSpec's, not changed) names and returns
// the spec QEMU starts: the exporter's Secret is there, the pod's guest
// disks (its config and secret volumes) are made and added, a
// snapshot-start pod's restore or save is prepared (snapshots.go), the
// whole is validated, and the overlay is made and grown (prepareDisk).
func (r *podRun) prepareRun(ctx context.Context, pod *corev1.Pod, run vmRun, img *oci.Image, spec qemu.Spec) (qemu.Spec, error) {
	p, rec := r.node, r.rec
	spec.Disks, spec.AllowedDirs = slices.Clone(spec.Disks), slices.Clone(spec.AllowedDirs)
	if err := exporter.CheckConfig(ctx, p.cfg.Secrets, pod); err != nil {
		return spec, err // the pod waits for its exporter Secret
	}
	guest, err := podspec.PrepareGuestDisks(ctx, rec.dir, pod, podspec.ConfigSources{Secret: p.cfg.Secrets, ConfigMap: p.cfg.ConfigMaps})
	if err != nil {
		return spec, err
	}
	spec.Disks = append(spec.Disks, guest...)
	base, baseFormat := img.Disk, qemu.DiskFormat(img.DiskFormat)
	if b := r.prepareSnapshotStart(ctx, pod, run.plan, img, &spec); b != "" { // snapshots.go
		base, baseFormat = b, qemu.FormatQCOW2
	}
	if err := spec.Validate(); err != nil {
		return spec, podspec.InvalidSpec{Err: fmt.Errorf("VM spec for image %s: %w", run.plan.Image, err)}
	}
	if exporter.IsEmptyDisk(img) {
		if err := exporter.EnsureEmptyDisk(ctx, img, run.plan.EmptyDiskBytes); err != nil {
			return spec, err
		}
	}
	if img.Disk != "" {
		if err := r.prepareDisk(ctx, pod, run, base, baseFormat); err != nil {
			return spec, err
		}
	}
	return spec, nil
}

// prepareDisk readies the run's overlay over base: a fresh one (each run
// starts from the image, as a container starts from its image), or with
// state policy Retain the one the last run left (poddisk.Prepare); then
// grown to a disk size set through the exporter (exporter/vmsize.go).
func (r *podRun) prepareDisk(ctx context.Context, pod *corev1.Pod, run vmRun, base string, baseFormat qemu.DiskFormat) error {
	p := r.node
	overlay := filepath.Join(run.dir, OverlayFileName)
	reason, msg, err := poddisk.Prepare(ctx, run.plan.StatePolicy, overlay, base, baseFormat)
	if err != nil {
		return err
	}
	if reason != "" {
		klog.FromContext(ctx).Info("VM disk", "reason", reason, "message", msg)
		p.event(pod, corev1.EventTypeNormal, reason, msg)
	}
	if run.size.DiskBytes <= 0 {
		return nil
	}
	grew, err := qemu.GrowImage(ctx, overlay, run.size.DiskBytes)
	if err != nil {
		return err
	}
	if grew {
		p.event(pod, corev1.EventTypeNormal, podstatus.ReasonResized, fmt.Sprintf("VM disk grown to %s", podspec.BytesOf(run.size.DiskBytes)))
	}
	return nil
}

// pullSecrets reads the pod's pull secrets as Docker config JSON documents;
// a missing secret is skipped with an event, as the kubelet does.
func (p *nodeWide) pullSecrets(ctx context.Context, pod *corev1.Pod, names []string) [][]byte {
	if p.cfg.Secrets == nil {
		return nil
	}
	var out [][]byte
	for _, n := range names {
		s, err := p.cfg.Secrets(ctx, pod.Namespace, n)
		if err != nil {
			p.event(pod, corev1.EventTypeWarning, "FailedToRetrieveImagePullSecret",
				fmt.Sprintf("Unable to retrieve image pull secret %q; the image pull may not succeed: %v", n, err))
			continue
		}
		if b, ok := s.Data[corev1.DockerConfigJsonKey]; ok {
			out = append(out, b)
		} else if b, ok := s.Data[corev1.DockerConfigKey]; ok {
			out = append(out, []byte(`{"auths":`+string(b)+`}`))
		}
	}
	return out
}

// releaseImage gives up the pod's hold on its image. Worker only (or a
// rejected pod's finishDelete: no worker).
func (r *podRun) releaseImage() {
	rec := r.rec
	rel := rec.release
	rec.release = nil
	if rel != nil {
		rel()
	}
}

func sleepCtx(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}
