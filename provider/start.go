package provider

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
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
// image hold, the VM spec (waiting for its config), the QEMU start and the
// record of the started run.
func (p *VMs) pullAndStart(ctx context.Context, rec *podVM) bool {
	log := klog.FromContext(ctx)
	p.dropSnapshotClaim(rec) // an earlier run's, unused
	pod, plan, size := p.runPlan(rec)

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

	img, ok := p.pullImage(pctx, rec, pod, plan, att)
	if !ok {
		return false
	}
	p.holdImage(ctx, rec, img)

	pod, spec, ok, err := p.waitForSpec(ctx, pctx, rec, pod, plan, img)
	if !ok {
		return false
	}
	att.Overlaid(err)
	if err != nil {
		reason := podstatus.ReasonStartError
		if _, ok := errors.AsType[podspec.InvalidSpec](err); ok {
			reason = podstatus.ReasonInvalidVMSpec
		}
		log.Error(err, "VM not started", "reason", reason)
		p.event(pod, corev1.EventTypeWarning, "Failed", err.Error())
		p.recordStartError(rec, reason, err)
		return false
	}
	vm, spec, err := p.startQEMU(ctx, pctx, rec, pod, plan, img, spec)
	att.QEMUStarted(vm, err)
	if err != nil {
		if pctx.Err() != nil {
			return false
		}
		log.Error(err, "QEMU start failed")
		p.event(pod, corev1.EventTypeWarning, "Failed", "Error: "+err.Error())
		p.recordStartError(rec, podstatus.ReasonStartError, err)
		return false
	}
	p.recordStarted(ctx, rec, pod, vm, spec, size)
	return true
}

// runPlan is what this run boots: the pod's plan with a flashed image and
// a size set through the exporter (exporter/vmsize.go) applied, and that size.
// It also forgets the previous run's snapshot use.
func (p *VMs) runPlan(rec *podVM) (*corev1.Pod, podspec.Plan, podstatus.VMSize) {
	rec.snap.used, rec.snap.restoreFailed = nil, false
	pod, st := rec.read()
	plan := rec.plan
	if st.FlashedImage != "" {
		// Flashed (package exporter): boot that image, pinned by digest.
		plan.Image, plan.PullPolicy = st.FlashedImage, oci.PullIfNotPresent
	}
	var size podstatus.VMSize
	if st.Size != nil {
		size = *st.Size
		if size.MemoryBytes > 0 {
			plan.MemoryMiB = podspec.MemoryMiB(size.MemoryBytes)
		}
		plan.DiskBytes = size.DiskBytes
	}
	return pod, plan, size
}

// pullObserver sees each pull attempt (the start's telemetry).
type pullObserver interface {
	Pulled(t0 time.Time, err error)
}

// pullImage returns the image to boot: a flashed root (package exporter),
// the cached image when the pull policy allows it, else a pull retried with
// back-off (ErrImagePull, then ImagePullBackOff). ok is false when ctx
// ended (delete, shutdown).
func (p *VMs) pullImage(ctx context.Context, rec *podVM, pod *corev1.Pod, plan podspec.Plan, att pullObserver) (img *oci.Image, ok bool) {
	log := klog.FromContext(ctx)
	// A flashed root (package exporter) boots instead of any image.
	img = exporter.FlashedRoot(rec.dir, rec.stateCopy())
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
		p.update(rec, func(st *podstatus.VMState) { st.SetWaiting(podstatus.ReasonErrImagePull, msg) })
		delay := p.cfg.Backoff.Delay(attempt)
		hold := min(p.cfg.ErrImagePullHold, delay)
		if !sleepCtx(ctx, hold) {
			return nil, false
		}
		p.update(rec, func(st *podstatus.VMState) {
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
func (p *VMs) holdImage(ctx context.Context, rec *podVM, img *oci.Image) {
	haveRelease := rec.release != nil && rec.stateCopy().ImageDigest == img.Digest
	if !haveRelease {
		p.releaseImage(rec)
	}
	if !haveRelease && !exporter.IsFlashedRoot(img) {
		if rel, err := p.cfg.Images.Acquire(img.Digest); err == nil {
			rec.release = rel
		} else {
			klog.FromContext(ctx).Error(err, "Acquire image")
		}
	}
	p.update(rec, func(st *podstatus.VMState) {
		st.ImageDigest = img.Digest
		st.ImageID = podspec.ImageID(img)
		st.SetWaiting(podstatus.ReasonContainerCreating, "")
	})
}

// waitForSpec builds the VM spec (vmSpec), waiting with back-off while a
// Secret or ConfigMap it needs is missing (CreateContainerConfigError, as
// a kubelet: podspec.PrepareGuestDisks). It returns the pod as last read
// and vmSpec's result; ok is false when pctx ended while waiting.
func (p *VMs) waitForSpec(ctx, pctx context.Context, rec *podVM, pod *corev1.Pod, plan podspec.Plan, img *oci.Image) (_ *corev1.Pod, _ qemu.Spec, ok bool, _ error) {
	log := klog.FromContext(ctx)
	spec, err := p.vmSpec(ctx, rec, pod, plan, img)
	for attempt := 1; err != nil && podspec.IsConfigError(err); attempt++ {
		msg := err.Error()
		log.Info("VM config not available", "err", msg)
		p.event(pod, corev1.EventTypeWarning, "Failed", "Error: "+msg)
		p.update(rec, func(st *podstatus.VMState) { st.SetWaiting(podspec.ReasonCreateContainerConfigError, msg) })
		if !sleepCtx(pctx, min(p.cfg.Backoff.Delay(attempt), podspec.ConfigRetryMax)) {
			return pod, spec, false, err
		}
		pod = rec.podCopy()
		spec, err = p.vmSpec(ctx, rec, pod, plan, img)
	}
	return pod, spec, true, err
}

// startQEMU starts the VM of spec, bounded by StartTimeout; a memory
// snapshot QEMU cannot load is discarded and the VM booted instead
// (snapshots.go). It returns the spec that started.
func (p *VMs) startQEMU(ctx, pctx context.Context, rec *podVM, pod *corev1.Pod, plan podspec.Plan, img *oci.Image, spec qemu.Spec) (VM, qemu.Spec, error) {
	sctx, scancel := context.WithTimeout(pctx, p.cfg.StartTimeout)
	vm, err := p.cfg.Hypervisor.Start(sctx, spec, rec.dir)
	scancel()
	if err != nil && spec.Incoming != "" && pctx.Err() == nil {
		// The snapshot cannot be loaded: discard it and boot (snapshots.go).
		p.restoreFailed(ctx, rec, pod, err)
		spec, err = p.vmSpec(ctx, rec, pod, plan, img)
		if err == nil {
			sctx, scancel := context.WithTimeout(pctx, p.cfg.StartTimeout)
			vm, err = p.cfg.Hypervisor.Start(sctx, spec, rec.dir)
			scancel()
		}
	}
	return vm, spec, err
}

// recordStartError records a start that failed as a terminated run (exit
// code 128, reason StartError or InvalidVMSpec).
func (p *VMs) recordStartError(rec *podVM, reason string, err error) {
	now := p.now()
	p.update(rec, func(st *podstatus.VMState) {
		st.SetTerminated(corev1.ContainerStateTerminated{ExitCode: 128, Reason: reason, Message: err.Error(),
			StartedAt: podstatus.MetaTime(now), FinishedAt: podstatus.MetaTime(now)})
	})
}

// recordStarted records the started run: the pod's VM, the Started event,
// Running, and the size this run applied.
func (p *VMs) recordStarted(ctx context.Context, rec *podVM, pod *corev1.Pod, vm VM, spec qemu.Spec, size podstatus.VMSize) {
	rec.vm.set(vm) // before Running shows: the console, exec and the rest find it
	from := ""
	if spec.Incoming != "" {
		from = ", restored from a memory snapshot"
	}
	klog.FromContext(ctx).Info("VM started", "pid", vm.Pid(), "accelerator", spec.Accelerator, "fromSnapshot", spec.Incoming != "")
	p.event(pod, corev1.EventTypeNormal, "Started", fmt.Sprintf("Started VM (QEMU pid %d, %s, %d vCPU, %d MiB%s)", vm.Pid(), spec.Accelerator, spec.CPUs, spec.MemoryMiB, from))
	p.update(rec, func(st *podstatus.VMState) {
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
func (p *VMs) presentImage(ctx context.Context, plan podspec.Plan) *oci.Image {
	if plan.PullPolicy == oci.PullAlways {
		return nil
	}
	img, err := p.cfg.Images.Pull(ctx, plan.Image, oci.PullOptions{Policy: oci.PullNever})
	if err != nil {
		return nil
	}
	return img
}

// vmSpec builds the VM spec for a pulled image and readies the overlay:
// a fresh one (each run starts from the image, as a container starts from
// its image), or with state policy Retain the one the last run left
// (poddisk.Prepare).
func (p *VMs) vmSpec(ctx context.Context, rec *podVM, pod *corev1.Pod, plan podspec.Plan, img *oci.Image) (qemu.Spec, error) {
	accel := qemu.Accelerator(p.cfg.Accelerator)
	if plan.Accelerator != "" {
		accel = qemu.Accelerator(plan.Accelerator)
	}
	spec := qemu.Spec{
		Name:        vmName(pod),
		Arch:        p.arch(),
		QEMUBinary:  p.cfg.QEMUBinary,
		Accelerator: accel,
		Machine:     plan.Machine,
		CPUs:        plan.CPUs,
		MemoryMiB:   plan.MemoryMiB,
		Firmware:    plan.Firmware,
		Kernel:      img.Kernel,
		Initrd:      img.Initrd,
		Cmdline:     strings.TrimSpace(img.Cmdline + " " + plan.ExtraCmdline),
		Network:     true,
		AllowedDirs: []string{p.cfg.ImageDir},
		StateDir:    rec.dir,
		Memory:      p.cfg.Memory,
		Nice:        p.cfg.VMNice,
		Display:     plan.Display,
		CPUModel:    podspec.CPUModel(plan, accel, p.cfg.CPUModels), // the pod's, else the node's, else qemu's default
		// features.consoleLogSize in force when the VM starts.
		ConsoleCapBytes: p.Features().ConsoleLogSize,
		Cgroup:          podspec.VMCgroup(p.cfg.VMCgroup, plan, p.cfg.VMOverhead),
		// The node's, never the pod's (its securityContext is not read).
		RunAs: p.cfg.VMUser,
	}
	if img.Kernel != "" {
		spec.Cmdline = podspec.KernelCmdline(p.arch(), img.Cmdline, plan.ExtraCmdline) // the arch's console unless one is named
		spec.Cmdline = podspec.EmulatedKernelCmdline(p.arch(), spec.Accelerator, spec.Cmdline, p.cfg.EmulatedKernelArgs)
	}
	if plan.Firmware == qemu.FirmwareUEFI {
		spec.UEFICode, spec.UEFIVarsTemplate = p.cfg.UEFICode, p.cfg.UEFIVars
		spec.AllowedDirs = append(spec.AllowedDirs, filepath.Dir(p.cfg.UEFICode), filepath.Dir(p.cfg.UEFIVars))
	}
	exporter.ApplyFlashedFirmware(rec.dir, rec.stateCopy().Flashed, p.cfg.UEFICode, p.cfg.UEFIVars, &spec)
	if img.Kernel == "" && plan.ExtraCmdline != "" {
		return spec, podspec.InvalidSpec{Err: fmt.Errorf("annotation %s: image %s has no kernel to pass a command line to", podspec.AnnotationKernelCmdline, plan.Image)}
	}
	overlay := filepath.Join(rec.dir, OverlayFileName)
	if img.Disk != "" {
		spec.Disks = []qemu.Disk{{Path: overlay, Format: qemu.FormatQCOW2}}
	}
	if err := exporter.CheckConfig(ctx, p.cfg.Secrets, pod); err != nil {
		return spec, err // the pod waits for its exporter Secret
	}
	guest, err := podspec.PrepareGuestDisks(ctx, rec.dir, pod, podspec.ConfigSources{Secret: p.cfg.Secrets, ConfigMap: p.cfg.ConfigMaps})
	if err != nil {
		return spec, err
	}
	spec.Disks = append(spec.Disks, guest...)
	base, baseFormat := img.Disk, qemu.DiskFormat(img.DiskFormat)
	if b := p.prepareSnapshotStart(ctx, rec, pod, plan, img, &spec); b != "" { // snapshots.go
		base, baseFormat = b, qemu.FormatQCOW2
	}
	if err := spec.Validate(); err != nil {
		return spec, podspec.InvalidSpec{Err: fmt.Errorf("VM spec for image %s: %w", plan.Image, err)}
	}
	if img.Disk != "" {
		reason, msg, err := poddisk.Prepare(ctx, plan.StatePolicy, overlay, base, baseFormat)
		if err != nil {
			return spec, err
		}
		if reason != "" {
			klog.FromContext(ctx).Info("VM disk", "reason", reason, "message", msg)
			p.event(pod, corev1.EventTypeNormal, reason, msg)
		}
		if plan.DiskBytes > 0 { // set through the exporter (exporter/vmsize.go)
			grew, err := qemu.GrowImage(ctx, overlay, plan.DiskBytes)
			if err != nil {
				return spec, err
			}
			if grew {
				p.event(pod, corev1.EventTypeNormal, podstatus.ReasonResized, fmt.Sprintf("VM disk grown to %s", podspec.BytesOf(plan.DiskBytes)))
			}
		}
	}
	return spec, nil
}

// arch is the node's guest architecture.
func (p *VMs) arch() qemu.Arch {
	if p.cfg.Arch != "" {
		return p.cfg.Arch
	}
	return qemu.HostArch()
}

// vmName is a QEMU-safe label: namespace.name, cut to 63 characters.
func vmName(pod *corev1.Pod) string {
	n := pod.Namespace + "." + pod.Name
	if len(n) > 63 {
		n = n[:63]
	}
	return strings.TrimRight(n, ".-_")
}

// pullSecrets reads the pod's pull secrets as Docker config JSON documents;
// a missing secret is skipped with an event, as the kubelet does.
func (p *VMs) pullSecrets(ctx context.Context, pod *corev1.Pod, names []string) [][]byte {
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
func (p *VMs) releaseImage(rec *podVM) {
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
